#!/usr/bin/env bash
# The tiny GGUF model of the llama.cpp tests and the demo (tests/engines/tiny_gguf.py), from a
# venv of its own with the pinned `gguf` package (target/gguf-venv).
#   tests/engines/gguf.sh --install   make the venv (needs PyPI; make test-deps runs it)
#   tests/engines/gguf.sh OUT.gguf    write the model (no network)
set -euo pipefail
cd "$(dirname "$0")/../.."
env=target/gguf-venv
want="gguf==0.19.0 numpy==2.4.6"
if [ "${1:-}" = --install ]; then
  [ -f "$env/.kvgate-installed" ] && [ "$(cat "$env/.kvgate-installed")" = "$want" ] && exit 0
  python3 -m venv "$env"
  "$env/bin/pip" install -q --disable-pip-version-check $want
  echo "$want" >"$env/.kvgate-installed"
  exit 0
fi
[ -x "$env/bin/python" ] || { echo "tests/engines/gguf.sh: $env is missing; make it with: make test-deps (or tests/engines/gguf.sh --install)" >&2; exit 1; }
exec "$env/bin/python" tests/engines/tiny_gguf.py "$1"
