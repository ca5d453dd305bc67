#!/usr/bin/env bash
# Pushes kvgate's images from their OCI image layouts (make images) to a registry (make push):
#   REGISTRY/kvgate-operator:VERSION and REGISTRY/kvgate-worker:VERSION (VERSION: the workspace's,
#   the chart's appVersion), then the chart as an OCI artifact, oci://REGISTRY/charts/kvgate:CHART
#   (CHART: the chart's own version; helm 3.8 or newer).
# The chart's `registry` value points every image it renders there:
#   helm install kvgate oci://REGISTRY/charts/kvgate --version CHART --set registry=REGISTRY
#
# usage: scripts/push.sh REGISTRY [--from DIR] [--insecure] [--no-chart] [IMAGE...]
#   REGISTRY    host[:port]/path, e.g. registry.example.com/kvgate (log in first: skopeo login HOST,
#               helm registry login HOST; both read the same credentials file)
#   --from DIR  where the layouts are (default target/images; the tests push target/images-debug)
#   --insecure  plain HTTP, no TLS (a registry inside a test world or a lab)
#   --no-chart  images only
#   IMAGE       kvgate-operator, kvgate-worker (default both), llamacpp, vllm
# Each image's tags are those of its layout (the workspace version); a tag already pushed is
# pushed again (a registry keeps the blobs it has and takes only the manifest).
set -euo pipefail
cd "$(dirname "$0")/.."

registry=""
from=target/images
insecure=0
chart=1
images=()
while [ $# -gt 0 ]; do
  case "$1" in
    --from) from=$2; shift 2 ;;
    --insecure) insecure=1; shift ;;
    --no-chart) chart=0; shift ;;
    kvgate-operator|kvgate-worker|llamacpp|vllm) images+=("$1"); shift ;;
    -*) echo "scripts/push.sh: unknown flag $1 (see the usage at the top of the script)" >&2; exit 2 ;;
    *) [ -z "$registry" ] || { echo "scripts/push.sh: one REGISTRY, got $registry and $1" >&2; exit 2; }; registry=$1; shift ;;
  esac
done
[ -n "$registry" ] || { echo "scripts/push.sh: REGISTRY is required, e.g. make push REGISTRY=registry.example.com/kvgate" >&2; exit 2; }
case "$registry" in
  */) echo "scripts/push.sh: REGISTRY $registry ends with /: name it as host[:port]/path" >&2; exit 2 ;;
  *://*) echo "scripts/push.sh: REGISTRY $registry names a scheme: name it as host[:port]/path (--insecure for plain HTTP)" >&2; exit 2 ;;
esac
[ ${#images[@]} -gt 0 ] || images=(kvgate-operator kvgate-worker)
command -v skopeo >/dev/null || { echo "scripts/push.sh: skopeo not found; install it with: apt-get install skopeo (make test-deps does)" >&2; exit 1; }
version=$(awk -F'"' '/^version = / { print $2; exit }' Cargo.toml)
tls=(--dest-tls-verify=true)
[ "$insecure" = 0 ] || tls=(--dest-tls-verify=false)

for image in "${images[@]}"; do
  layout="$from/oci/$image"
  [ -f "$layout/index.json" ] || { echo "scripts/push.sh: $layout is not an OCI image layout; build it with make images" >&2; exit 1; }
  # Policy: the images are ours, signed by nobody yet; the host's /etc/containers may not exist.
  skopeo copy -q --insecure-policy "${tls[@]}" "oci:$layout:$version" "docker://$registry/$image:$version"
  echo "pushed $registry/$image:$version"
done

if [ "$chart" = 1 ]; then
  helm=${HELM:-$(command -v helm || echo target/tools/bin/helm)}
  [ -x "$helm" ] || { echo "scripts/push.sh: helm not found; build it with make tools (target/tools/bin/helm) or pass HELM=" >&2; exit 1; }
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$helm" package charts/kvgate --destination "$tmp" >/dev/null
  plain=()
  [ "$insecure" = 0 ] || plain=(--plain-http)
  chart_version=$(sed -n 's/^version: *//p' charts/kvgate/Chart.yaml)
  "$helm" push "$tmp/kvgate-$chart_version.tgz" "oci://$registry/charts" "${plain[@]}" >/dev/null
  echo "pushed oci://$registry/charts/kvgate:$chart_version"
fi
