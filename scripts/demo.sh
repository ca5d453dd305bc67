#!/usr/bin/env bash
# make demo: a local control plane and node agent, the CRDs and the Helm chart, the tiny example
# (Available, answering a completion) and the incident example (refused with both numbers).
# Stays up for kubectl until Ctrl-C. Needs root: the cluster lives in network namespaces of its own
# (pods wired by the CNI bridge plugin, limits through cgroups); the host reaches it only through
# relays on 127.0.0.1 and is never given an address, route or link.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s test-deps controlplane tools
cargo build -q -p kvgate-worker -p kvgate-operator -p kvgate-testenv
kubeconfig=target/dev-cluster/kubeconfig
rm -f "$kubeconfig"
target/debug/kvgate-dev-cluster --forward demo/tiny &
cluster=$!
trap 'kill $cluster 2>/dev/null; wait $cluster 2>/dev/null || true' EXIT INT TERM
for _ in $(seq 120); do [ -s "$kubeconfig" ] && break; sleep 0.5; done
[ -s "$kubeconfig" ] || { echo "the dev cluster did not come up"; exit 1; }
export KUBECONFIG=$PWD/$kubeconfig
helm=target/tools/bin/helm
kubectl() { target/controlplane/bin/kubectl "$@"; }

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
step "helm install kvgate charts/kvgate -n kvgate-system --create-namespace (the CRD comes with it)"
$helm install kvgate charts/kvgate -n kvgate-system --create-namespace --wait --timeout 120s
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
step "a completion through tiny's router (relayed to 127.0.0.1)"
port=$(cat target/dev-cluster/forward/demo.tiny)
echo "curl http://127.0.0.1:$port/v1/completions -d '{\"prompt\":\"Hello\",\"max_tokens\":8,\"temperature\":0}'"
curl -s --retry 20 --retry-all-errors --retry-delay 1 "http://127.0.0.1:$port/v1/completions" -d '{"prompt":"Hello","max_tokens":8,"temperature":0}'; echo
step "kubectl -n demo logs -l app.kubernetes.io/instance=tiny,app.kubernetes.io/component=prefill --tail=3 (through the API server and the node agent's kubelet port)"
kubectl -n demo logs -l app.kubernetes.io/instance=tiny,app.kubernetes.io/component=prefill --tail=3
step "why incident is refused"
kubectl -n demo get infd incident -o jsonpath='{.status.conditions[?(@.type=="RolloutRefused")].message}'; echo
kubectl -n demo get events --field-selector reason=RolloutRefused
cat <<MSG

The demo cluster stays up. In another shell:
  export KUBECONFIG=$KUBECONFIG
  target/controlplane/bin/kubectl get infd -A -w
  target/controlplane/bin/kubectl -n demo describe infd incident
  target/controlplane/bin/kubectl -n demo logs -f deploy/tiny-router
  curl http://127.0.0.1:$port/v1/completions -d '{"prompt":"Hello","max_tokens":8}'
Press Ctrl-C to stop everything.
MSG
wait $cluster
