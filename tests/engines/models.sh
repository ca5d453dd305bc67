#!/usr/bin/env bash
# The models of the engine tests and the demo, made locally from seeded random weights, from a
# venv of their own with pinned packages (target/models-venv):
#   tests/engines/models.sh --install     make the venv (needs PyPI; make test-deps runs it)
#   tests/engines/models.sh gguf OUT      llama.cpp's: an f32 GGUF written with the gguf package
#   tests/engines/models.sh hf DIR        vLLM's: config.json and model.safetensors
set -euo pipefail
cd "$(dirname "$0")/../.."
env=target/models-venv
want="gguf==0.19.0 numpy==2.4.6 safetensors==0.7.0"
if [ "${1:-}" = --install ]; then
  [ -f "$env/.kvgate-installed" ] && [ "$(cat "$env/.kvgate-installed")" = "$want" ] && exit 0
  python3 -m venv "$env"
  "$env/bin/pip" install -q --disable-pip-version-check $want
  echo "$want" >"$env/.kvgate-installed"
  exit 0
fi
[ -x "$env/bin/python" ] || { echo "tests/engines/models.sh: $env is missing; make it with: make test-deps (or tests/engines/models.sh --install)" >&2; exit 1; }
case "${1:-}" in
  gguf) exec "$env/bin/python" tests/engines/tiny_gguf.py "$2" ;;
  hf) exec "$env/bin/python" tests/engines/tiny_hf.py "$2" ;;
  *) echo "usage: tests/engines/models.sh --install | gguf OUT | hf DIR" >&2; exit 2 ;;
esac
