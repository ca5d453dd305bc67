#!/usr/bin/env bash
# Builds the helm client (v3.22.0, pinned by go.mod) the chart tests use into target/tools/bin/.
# Idempotent: Go's build cache makes a second run with nothing changed take seconds.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${TOOLS_BIN:-$here/../../target/tools/bin}
mkdir -p "$out"
source "$here/../go-build.sh"
require_go
cd "$here"
# As helm's own release build does: the Kubernetes version it assumes without a cluster
# (`helm template`, `helm lint`) follows the client-go it is built with (v0.37 -> 1.37). Without
# these flags it believes v1.20.0 and refuses charts that need a newer one.
client_go=$(go list -f '{{.Version}}' -m k8s.io/client-go)
minor=$(echo "$client_go" | cut -d. -f2)
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=v3.22.0"
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  ldflags="$ldflags -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$minor"
done
with_progress "building helm (helm.sh/helm/v3/cmd/helm, Kubernetes 1.$minor from client-go $client_go)" \
  go build -trimpath -ldflags "$ldflags" -o "$out/helm" helm.sh/helm/v3/cmd/helm
"$out/helm" version --short
