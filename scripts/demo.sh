#!/usr/bin/env bash
# make demo: a local control plane, two nodes and an image registry; kvgate's images and chart
# pushed there as `make push` does and the chart installed from it; the tiny example
# (Available, answering a completion), the incident example (refused with both numbers) and
# llama.cpp's real server split into slots smaller than its declared window (refused with
# llama.cpp's own numbers), and kvgate's own workers serving that same GGUF file with 8-bit KV.
# Stays up for kubectl until Ctrl-C. Needs root: the cluster lives in network namespaces of its own
# (pods wired by the CNI bridge plugin, limits through cgroups); the host reaches it only through
# relays on 127.0.0.1 and is never given an address, route or link.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step says how long the one before it took; headings are bold only on a terminal.
bold='' plain=''
[ -t 1 ] && bold=$'\033[1m' plain=$'\033[0m'
began=$SECONDS step_name='' step_start=$SECONDS
took() { [ -z "$step_name" ] || printf '   (%s: %d s)\n' "$step_name" $((SECONDS - step_start)); }
step() {
  took
  step_name=$* step_start=$SECONDS
  printf '\n%s== %s%s\n' "$bold" "$*" "$plain"
}

# Only what the demo needs: not the linters, Prometheus or the Python tools the tests use.
step "dependencies: Debian packages for the node agent and the images (scripts/test-deps.sh --demo)"
bash scripts/test-deps.sh --demo
step "the control plane from the Kubernetes Go modules (first time about 30 minutes on 2 cores)"
bash tests/controlplane/build.sh
step "helm, the registry and the CNI plugins"
bash tests/tools/build.sh --demo
bash tests/cni/build.sh
step "cargo build of the worker, the operator and the dev cluster"
cargo build -q -p kvgate-worker -p kvgate-operator -p kvgate-testenv
kubeconfig=target/dev-cluster/kubeconfig
rm -f "$kubeconfig"
step "the dev cluster: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, an image registry and two nodes (node agents, each in a network namespace of its own) pulling images from it and running pods under runc"
target/debug/kvgate-dev-cluster --forward engines/tiny-gguf &
cluster=$!
stop() {
  kill "$cluster" 2>/dev/null || true
  wait "$cluster" 2>/dev/null || true
}
# Ctrl-C is how the demo ends: stop the cluster and exit 0.
trap 'echo; echo "stopping the dev cluster"; stop; exit 0' INT TERM
trap stop EXIT
for _ in $(seq 120); do [ -s "$kubeconfig" ] && break; sleep 0.5; done
[ -s "$kubeconfig" ] || { echo "the dev cluster did not come up"; exit 1; }
export KUBECONFIG=$PWD/$kubeconfig
helm=target/tools/bin/helm
kubectl() { target/controlplane/bin/kubectl "$@"; }

# The llama.cpp example's model: a random Llama as a GGUF, in a node directory the operator may mount.
models=$PWD/target/dev-cluster/models
mkdir -p "$models"
bash tests/engines/models.sh gguf "$models/tiny.gguf" >/dev/null
# The registry as this machine reaches it (a relay to 127.0.0.1), and as the nodes do.
registry=$(cat target/dev-cluster/registry)/kvgate
node_registry=$(cat target/dev-cluster/registry-for-nodes)/kvgate
chart_version=$(sed -n 's/^version: *//p' charts/kvgate/Chart.yaml)
step "make push REGISTRY=$registry INSECURE=1: the images (here the debug builds the cluster runs) and the chart"
HELM=$helm bash scripts/push.sh "$registry" --from target/images-debug --insecure
step "helm install kvgate oci://$registry/charts/kvgate --set registry=$node_registry (the CRD comes with it)"
$helm install kvgate "oci://$registry/charts/kvgate" --version "$chart_version" --plain-http --set registry="$node_registry" \
  -n kvgate-system --create-namespace --wait --timeout 120s
kubectl wait --for=condition=Established crd/inferencedeployments.kvgate.dev --timeout=30s
step "helm test kvgate -n kvgate-system"
$helm test kvgate -n kvgate-system
step "kubectl -n demo apply -f examples/tiny.yaml -f examples/incident.yaml"
kubectl create namespace demo
# The API server's own PodSecurity admission refuses any pod here that is not `restricted`.
kubectl label namespace demo pod-security.kubernetes.io/enforce=restricted
kubectl -n demo apply -f examples/tiny.yaml -f examples/incident.yaml
kubectl -n demo wait --for=jsonpath='{.status.phase}'=Available infd/tiny --timeout=180s
kubectl -n demo wait --for=jsonpath='{.status.phase}'=Refused infd/incident --timeout=180s
step "kubectl -n demo get infd"
kubectl -n demo get infd
step "kubectl -n demo port-forward svc/tiny :80, and a completion through it"
forward_log=target/dev-cluster/port-forward.log
kubectl -n demo port-forward svc/tiny :80 >"$forward_log" 2>&1 &
forward=$!
stop() {
  kill "$forward" "$cluster" 2>/dev/null || true
  wait "$cluster" 2>/dev/null || true
}
port=''
for _ in $(seq 60); do
  port=$(sed -n 's/^Forwarding from 127.0.0.1:\([0-9]*\) .*/\1/p' "$forward_log")
  [ -n "$port" ] && break
  sleep 0.5
done
[ -n "$port" ] || { echo "kubectl port-forward did not start:"; cat "$forward_log"; exit 1; }
echo "curl http://127.0.0.1:$port/v1/completions -d '{\"prompt\":\"Hello\",\"max_tokens\":8,\"temperature\":0}'"
curl -s --retry 20 --retry-all-errors --retry-delay 1 "http://127.0.0.1:$port/v1/completions" -d '{"prompt":"Hello","max_tokens":8,"temperature":0}'; echo
step "kubectl -n demo logs -l app.kubernetes.io/instance=tiny,app.kubernetes.io/component=prefill --tail=3 (through the API server and the node agent's kubelet port)"
kubectl -n demo logs -l app.kubernetes.io/instance=tiny,app.kubernetes.io/component=prefill --tail=3
step "kubectl kvgate why incident (the plugin target/debug/kubectl-kvgate, found by kubectl on PATH; exits 1 for a refusal)"
PATH="$PWD/target/debug:$PATH" kubectl kvgate why incident -n demo || true
step "an engine you already run: examples/llamacpp.yaml, llama.cpp's server with -c 4096 -np 4 declaring 4096 tokens"
# Its model is on the claim `models`, bound here to a node directory holding the tiny GGUF (a
# PersistentVolume an administrator makes; pods only name the claim, so the namespace stays
# restricted and the chart's defaults suffice).
kubectl create namespace engines
kubectl label namespace engines pod-security.kubernetes.io/enforce=restricted
kubectl apply -f - <<YAML
apiVersion: v1
kind: PersistentVolume
metadata: { name: demo-models }
spec:
  capacity: { storage: 1Gi }
  accessModes: [ReadOnlyMany]
  storageClassName: ""
  hostPath: { path: $models, type: Directory }
  claimRef: { namespace: engines, name: models }
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: { name: models, namespace: engines }
spec:
  accessModes: [ReadOnlyMany]
  storageClassName: ""
  resources: { requests: { storage: 1Gi } }
YAML
kubectl -n engines apply -f examples/llamacpp.yaml
kubectl -n engines wait --for=jsonpath='{.status.phase}'=Refused infd/llamacpp --timeout=180s
kubectl get infd -A
kubectl -n engines get infd llamacpp -o jsonpath='{.status.conditions[?(@.type=="RolloutRefused")].message}'; echo
step "kvgate's own workers from the same GGUF file, K and V stored in 8 bits (kvPool.dtype: q8_0)"
kubectl -n engines apply -f - <<YAML
apiVersion: kvgate.dev/v1alpha1
kind: InferenceDeployment
metadata: { name: tiny-gguf }
spec:
  model: { path: tiny.gguf, volume: { persistentVolumeClaim: models } }
  contextWindow: 2048
  prefill: { replicas: 1, kvPool: { tokens: 8192, pageSize: 16, dtype: q8_0 } }
  decode: { replicas: 1, kvPool: { tokens: 8192, pageSize: 16, dtype: q8_0 } }
YAML
kubectl -n engines wait --for=jsonpath='{.status.phase}'=Available infd/tiny-gguf --timeout=180s
kubectl -n engines get infd tiny-gguf
gguf_port=$(cat target/dev-cluster/forward/engines.tiny-gguf)
curl -s --retry 20 --retry-all-errors --retry-delay 1 "http://127.0.0.1:$gguf_port/v1/completions" -d '{"prompt":"Hello","max_tokens":8,"temperature":0}'; echo
took
echo "   (the demo took $((SECONDS - began)) s in all)"
cat <<MSG

The demo cluster stays up. In another shell:
  export KUBECONFIG=$KUBECONFIG
  target/controlplane/bin/kubectl get infd -A -w
  target/controlplane/bin/kubectl -n demo describe infd incident
  target/controlplane/bin/kubectl -n demo logs -f deploy/tiny-router
  curl http://127.0.0.1:$port/v1/completions -d '{"prompt":"Hello","max_tokens":8}'
Press Ctrl-C to stop everything.
MSG
wait "$cluster"
