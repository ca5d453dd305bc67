#!/usr/bin/env bash
# Installs the Debian packages the tests use when they are missing (run by `make test`).
# With --demo, only what `make demo` needs: the node agent's tools (iproute2, runc, umoci,
# skopeo), curl, python3 (the llama.cpp image's wheel is fetched with pip) and the images' pinned
# packages; no Prometheus, nftables or the tests' Python tools.
#   ip, tc (iproute2): the test world's links (pods' network namespaces, injected network faults).
#   nft (nftables): the test that shows the host's firewall ruleset unchanged.
#   prometheus, promtool (prometheus): the alert-rule tests and the live-Prometheus test.
#   python3: dashboards/generate.py --check.
#   curl: worker/tests/readme.rs runs docs/worker.md's commands as written.
#   jq: worker/tests/traces.rs runs docs/observability.md's walk from a mismatch to its request.
#   python3-venv: scripts/py-deps.sh's virtual environment (the official openai client and
#   lm-evaluation-harness, which worker/tests/clients.rs runs against the worker).
#   runc: the node agent runs pods' containers with it.
#   umoci, skopeo: scripts/images.sh builds the kvgate images (the tests run them under runc);
#   it fetches the llama.cpp image's wheel with pip from a venv (python3-venv), and the
#   llama.cpp tests' model is written with the `gguf` package (tests/engines/models.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
demo=0
[ "${1:-}" = --demo ] && demo=1
missing=()
command -v ip >/dev/null && command -v tc >/dev/null || missing+=(iproute2)
command -v curl >/dev/null || missing+=(curl)
for tool in runc umoci skopeo; do command -v $tool >/dev/null || missing+=($tool); done
command -v python3 >/dev/null || missing+=(python3)
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
if [ "$demo" = 0 ]; then
  command -v nft >/dev/null || missing+=(nftables)
  command -v jq >/dev/null || missing+=(jq)
  command -v prometheus >/dev/null && command -v promtool >/dev/null || missing+=(prometheus)
fi
# The pinned Debian packages the kvgate images are made of (scripts/images.sh): fetched here, in
# the host's network namespace, because the tests build their images inside the test world's.
# Then the tests' Python tools (not for the demo).
finish() {
  bash scripts/images.sh --fetch
  bash tests/engines/models.sh --install
  [ "$demo" = 1 ] || exec bash scripts/py-deps.sh
}
[ ${#missing[@]} -eq 0 ] && finish && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "missing Debian packages: ${missing[*]}; install them with: apt-get install ${missing[*]}" >&2
  exit 1
fi
echo "installing ${missing[*]}"
apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
finish
