#!/usr/bin/env bash
# The Python tools the tests run, in target/pyenv (run by `make test-deps`), pinned: the official
# `openai` client and lm-evaluation-harness (against the worker); yamllint and yamale (which
# `ct lint` runs), checkov (on the rendered chart) and numpy (engines/vllm's tests). Installed
# from PyPI once (about two minutes); later runs find them and return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
env=target/pyenv
want="openai==3.57.0 lm-eval[api]==0.4.13 yamllint==1.38.0 yamale==6.1.0 checkov==3.3.30 numpy==2.4.6"
stamp="$env/.kvgate-installed"
[ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && exit 0
echo "installing $want into $env (once; about two minutes)"
python3 -m venv "$env"
"$env/bin/pip" install -q --disable-pip-version-check $want
echo "$want" > "$stamp"
