#!/usr/bin/env bash
# vLLM's CPU build in target/vllm-venv, from the pinned wheels make test-vllm-deps fetched
# (images/vllm/requirements.txt, checked by digest): for what runs vLLM outside the test cluster
# (engines/vllm/bench/ttft.py). Installed once (about a minute); later runs return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
env=target/vllm-venv
stamp="$env/.kvgate-installed"
want=$(sha256sum images/vllm/requirements.txt | cut -d' ' -f1)
[ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && exit 0
command -v python3.11 >/dev/null || { echo "scripts/vllm-venv.sh: python3.11 is missing (the pinned wheels are cp311); install it, e.g. apt-get install python3.11-venv" >&2; exit 1; }
[ -d target/images/wheels ] || { echo "scripts/vllm-venv.sh: no wheels in target/images/wheels: run make test-vllm-deps" >&2; exit 1; }
echo "installing vLLM's pinned wheels into $env (once)"
rm -rf "$env"
python3.11 -m venv "$env"
"$env/bin/pip" install -q --disable-pip-version-check --no-index --no-deps --find-links target/images/wheels --require-hashes -r images/vllm/requirements.txt
echo "$want" > "$stamp"
