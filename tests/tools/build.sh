#!/usr/bin/env bash
# Builds the helm client (v3.22.0, pinned by go.mod) the chart tests use into target/tools/bin/.
# Idempotent: Go's build cache makes a second run with nothing changed take seconds.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${TOOLS_BIN:-$here/../../target/tools/bin}
mkdir -p "$out"
command -v go >/dev/null || { echo "go not found: install Go 1.26 or newer (https://go.dev/dl/ or your distribution's golang package)"; exit 1; }
cd "$here"
echo "building helm (helm.sh/helm/v3/cmd/helm)"
go build -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=v3.22.0" -o "$out/helm" helm.sh/helm/v3/cmd/helm
"$out/helm" version --short
