#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager (Kubernetes v1.37.2) and etcd (v3.7.3, pinned by
# go.mod, at least what Kubernetes requires) from the official Go modules into target/controlplane/bin/.
# Idempotent: Go's build cache makes a second run with nothing changed take seconds.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${CONTROLPLANE_BIN:-$here/../../target/controlplane/bin}
mkdir -p "$out"
command -v go >/dev/null || { echo "go not found: install Go 1.26 or newer (https://go.dev/dl/ or your distribution's golang package)"; exit 1; }
cd "$here"
k8s=v1.37.2
ldflags="-s -w \
 -X k8s.io/component-base/version.gitVersion=$k8s \
 -X k8s.io/component-base/version.gitMajor=1 \
 -X k8s.io/component-base/version.gitMinor=37 \
 -X k8s.io/component-base/version.gitTreeState=clean \
 -X k8s.io/client-go/pkg/version.gitVersion=$k8s"
build() {
  local name=$1 pkg=$2
  echo "building $name ($pkg)"
  go build -trimpath -ldflags "$ldflags" -o "$out/$name" "$pkg"
}
# The first line of a command's output. Captured whole, then cut: `cmd | head -1` under
# pipefail fails with 141 whenever cmd writes after head has exited (SIGPIPE).
first_line() {
  local text
  text=$("$@")
  echo "${text%%$'\n'*}"
}
# CONTROLPLANE_VERSIONS_ONLY=1 prints the versions of what is in $out without building (the
# harness tests run it this way against binaries that write a lot).
if [ -z "${CONTROLPLANE_VERSIONS_ONLY:-}" ]; then
  build kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver
  build kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager
  build etcd go.etcd.io/etcd/server/v3
fi
first_line "$out/kube-apiserver" --version
first_line "$out/etcd" --version
