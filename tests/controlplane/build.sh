#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager, kube-scheduler, kubectl (Kubernetes v1.37.2) and etcd (v3.7.3, pinned by
# go.mod, at least what Kubernetes requires) from the official Go modules into target/controlplane/bin/.
# Idempotent: Go's build cache makes a second run with nothing changed take seconds.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${CONTROLPLANE_BIN:-$here/../../target/controlplane/bin}
mkdir -p "$out"
source "$here/../go-build.sh"
require_go
cd "$here"
k8s=v1.37.2
ldflags="-s -w \
 -X k8s.io/component-base/version.gitVersion=$k8s \
 -X k8s.io/component-base/version.gitMajor=1 \
 -X k8s.io/component-base/version.gitMinor=37 \
 -X k8s.io/component-base/version.gitTreeState=clean \
 -X k8s.io/client-go/pkg/version.gitVersion=$k8s \
 -X k8s.io/client-go/pkg/version.gitMajor=1 \
 -X k8s.io/client-go/pkg/version.gitMinor=37"
# A cold build takes about 30 minutes on 2 cores: say so, and show a line every 30 seconds so a
# newcomer never stares at a silent terminal. Warm builds (Go's cache) take seconds.
build() {
  local name=$1 pkg=$2
  with_progress "building $name ($pkg)" go build -trimpath -ldflags "$ldflags" -o "$out/$name" "$pkg"
}
# CONTROLPLANE_VERSIONS_ONLY=1 prints the versions of what is in $out without building (the
# harness tests run it this way against binaries that write a lot).
if [ -z "${CONTROLPLANE_VERSIONS_ONLY:-}" ]; then
  [ -x "$out/kube-apiserver" ] || echo "first build of the control plane from the Kubernetes Go modules: about 30 minutes on 2 cores (seconds afterwards)"
  build kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver
  build kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager
  build kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler
  build etcd go.etcd.io/etcd/server/v3
  build kubectl k8s.io/kubernetes/cmd/kubectl
fi
first_line "$out/kube-apiserver" --version
first_line "$out/etcd" --version
