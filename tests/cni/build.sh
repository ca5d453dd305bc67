#!/usr/bin/env bash
# Builds the CNI reference plugins the node agent wires pods with (bridge, host-local, loopback;
# github.com/containernetworking/plugins v1.10.0, pinned by go.mod) into target/cni/bin/.
# Idempotent: Go's build cache makes a second run with nothing changed take seconds.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${CNI_BIN:-$here/../../target/cni/bin}
mkdir -p "$out"
source "$here/../go-build.sh"
require_go
cd "$here"
plugins=github.com/containernetworking/plugins/plugins
with_progress "building the CNI plugins bridge, host-local, loopback ($plugins)" \
  go build -trimpath -ldflags "-s -w" -o "$out/" "$plugins/main/bridge" "$plugins/ipam/host-local" "$plugins/main/loopback"
