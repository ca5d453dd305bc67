#!/usr/bin/env bash
# Builds the helm client (v3.22.0, pinned by go.mod), the chart linters (ct, kube-score,
# kubeconform; lint/go.mod) the chart tests use, and the trace and alert backends the
# observability tests run (Jaeger v1.76.0, jaeger/go.mod; Alertmanager v0.35.0) and the test
# world's image registry (the CNCF distribution registry v3.1.2, registry/go.mod) into
# target/tools/bin/. With --demo, helm and the registry alone (what `make demo` needs).
# Idempotent: Go's build cache makes a second run with nothing changed take seconds.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${TOOLS_BIN:-$here/../../target/tools/bin}
mkdir -p "$out"
source "$here/../go-build.sh"
require_go
cd "$here"
# TOOLS_VERSIONS_ONLY=1 prints the versions of what is in $out without building (as
# CONTROLPLANE_VERSIONS_ONLY does for the control plane; the build-script test runs it).
if [ -n "${TOOLS_VERSIONS_ONLY:-}" ]; then
  first_line "$out/helm" version --short
  first_line "$out/ct" version
  first_line "$out/jaeger" version
  first_line "$out/alertmanager" --version
  first_line "$out/registry" --version
  exit 0
fi
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
first_line "$out/helm" version --short
# The CNCF distribution registry (what most private registries run), from its own module: the
# test world's nodes pull their images from it (kvgate_testenv::registry).
cd "$here/registry"
with_progress "building registry (github.com/distribution/distribution/v3/cmd/registry v3.1.2)" \
  go build -trimpath -ldflags "-s -w -X github.com/distribution/distribution/v3/version.version=v3.1.2" -o "$out/registry" github.com/distribution/distribution/v3/cmd/registry
first_line "$out/registry" --version
[ "${1:-}" = --demo ] && exit 0

# The chart linters (tests/tools/lint/go.mod pins them; their own module so their dependencies
# never move helm's): chart-testing's `ct` with its default lint and schema configuration (from
# its module, into target/tools/ct/; the chart tests set CT_CONFIG_DIR there), kube-score and
# kubeconform.
cd "$here/lint"
with_progress "building ct, kube-score and kubeconform" bash -c '
  go build -trimpath -o "$1/ct" github.com/helm/chart-testing/v3/ct &&
  go build -trimpath -o "$1/kube-score" github.com/zegl/kube-score/cmd/kube-score &&
  go build -trimpath -o "$1/kubeconform" github.com/yannh/kubeconform/cmd/kubeconform' _ "$out"
ct_etc="$(go list -m -f '{{.Dir}}' github.com/helm/chart-testing/v3)/etc"
mkdir -p "$out/../ct"
install -m 0644 "$ct_etc/chart_schema.yaml" "$ct_etc/lintconf.yaml" "$out/../ct/"
first_line "$out/ct" version

# Jaeger v2 (the OpenTelemetry-collector-based binary), from its own module so its many
# dependencies never move helm's or the linters'. The first build takes about 10 minutes on 2
# cores.
cd "$here/jaeger"
with_progress "building jaeger (github.com/jaegertracing/jaeger/cmd/jaeger v1.76.0)" \
  go build -trimpath -ldflags "-s -w -X github.com/jaegertracing/jaeger/internal/version.latestVersion=v1.76.0" -o "$out/jaeger" github.com/jaegertracing/jaeger/cmd/jaeger
first_line "$out/jaeger" version

# Alertmanager, built inside a copy of its module (its own go.mod and go.sum pin what it was
# released with). Its web UI is an npm build the module does not ship: the embed gets a
# placeholder page, the API (/api/v2) is whole.
am_version=v0.35.0
am_src="$out/../src/alertmanager-$am_version"
if [ ! -f "$am_src/go.mod" ]; then
  # Outside any module: downloading touches no go.mod of ours.
  module_dir=$(cd / && go mod download -json github.com/prometheus/alertmanager@$am_version | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  rm -rf "$am_src"
  mkdir -p "$(dirname "$am_src")"
  cp -r "$module_dir" "$am_src"
  chmod -R u+w "$am_src"
  for ui in elm mantine; do
    mkdir -p "$am_src/ui/app/dist/$ui"
    echo '<!doctype html><title>Alertmanager</title><p>Web UI not built here; the API is at /api/v2/.' >"$am_src/ui/app/dist/$ui/index.html"
  done
fi
cd "$am_src"
with_progress "building alertmanager (github.com/prometheus/alertmanager/cmd/alertmanager $am_version)" \
  go build -trimpath -ldflags "-s -w -X github.com/prometheus/common/version.Version=${am_version#v}" -o "$out/alertmanager" ./cmd/alertmanager
first_line "$out/alertmanager" --version
