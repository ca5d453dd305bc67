#!/usr/bin/env bash
# Runs a Python bench script (bench/peer.py, bench/load.py, bench/plot.py) in the benches' own
# venv: target/bench-venv, or $KVGATE_BENCH_VENV. Pinned torch, transformers, matplotlib, gguf,
# xllamacpp (llama.cpp's server, a prebuilt CPU wheel) and guidellm (a load generator) from PyPI;
# nothing is downloaded from a model hub. Used by `make bench`, never by `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVGATE_BENCH_VENV:-target/bench-venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" || { echo "python3 -m venv failed: install python3-venv (make test-deps does)" >&2; exit 1; }
fi
# torch's default wheel carries CUDA libraries (several GB); it runs on the CPU all the same.
"$VENV/bin/pip" install --quiet --disable-pip-version-check \
    torch==2.15.0 transformers==5.24.0 safetensors==0.8.0 matplotlib==3.10.8 gguf==0.19.0 xllamacpp==2026.10.11549 guidellm==0.8.1
exec "$VENV/bin/python" "$@"
