#!/usr/bin/env bash
# The Python clients the tests run against the worker, in target/pyenv (run by `make test-deps`):
# the official `openai` client and lm-evaluation-harness, pinned. Installed from PyPI once;
# later runs find them and return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
env=target/pyenv
want="openai==3.57.0 lm-eval[api]==0.4.13"
stamp="$env/.kvgate-installed"
[ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && exit 0
echo "installing $want into $env (once; about a minute)"
python3 -m venv "$env"
"$env/bin/pip" install -q --disable-pip-version-check $want
echo "$want" > "$stamp"
