#!/usr/bin/env bash
# make demo: a local control plane and node agent, the CRDs and the Helm chart, the tiny example
# (Available, answering a completion) and the incident example (refused with both numbers).
# Stays up for kubectl until Ctrl-C. Needs root (the node agent adds pod addresses on lo).
set -euo pipefail
cd "$(dirname "$0")/.."
make -s test-deps controlplane tools
cargo build -q -p kvgate-worker -p kvgate-operator -p kvgate-testenv
kubeconfig=target/dev-cluster/kubeconfig
rm -f "$kubeconfig"
target/debug/kvgate-dev-cluster &
cluster=$!
trap 'kill $cluster 2>/dev/null; wait $cluster 2>/dev/null || true' EXIT INT TERM
for _ in $(seq 120); do [ -s "$kubeconfig" ] && break; sleep 0.5; done
[ -s "$kubeconfig" ] || { echo "the dev cluster did not come up"; exit 1; }
export KUBECONFIG=$PWD/$kubeconfig
helm=target/tools/bin/helm

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
step "kubectl apply -f crds/"
kubectl apply -f crds/
kubectl wait --for=condition=Established crd/inferencedeployments.kvgate.dev --timeout=30s
step "helm install kvgate charts/kvgate -n kvgate-system --create-namespace"
$helm install kvgate charts/kvgate -n kvgate-system --create-namespace --wait --timeout 120s
step "kubectl -n demo apply -f examples/tiny.yaml -f examples/incident.yaml"
kubectl create namespace demo
kubectl -n demo apply -f examples/tiny.yaml -f examples/incident.yaml
kubectl -n demo wait --for=jsonpath='{.status.phase}'=Available infd/tiny --timeout=180s
kubectl -n demo wait --for=jsonpath='{.status.phase}'=Refused infd/incident --timeout=180s
step "kubectl -n demo get infd"
kubectl -n demo get infd
step "a completion through tiny's router"
router=""
for _ in $(seq 60); do
  router=$(kubectl -n demo get endpointslices -l kubernetes.io/service-name=tiny \
    -o jsonpath='{.items[0].endpoints[?(@.conditions.ready==true)].addresses[0]}' 2>/dev/null || true)
  [ -n "$router" ] && break; sleep 0.5
done
echo "curl http://$router:8080/v1/completions -d '{\"prompt\":\"Hello\",\"max_tokens\":8,\"temperature\":0}'"
curl -s "http://$router:8080/v1/completions" -d '{"prompt":"Hello","max_tokens":8,"temperature":0}'; echo
step "why incident is refused"
kubectl -n demo get infd incident -o jsonpath='{.status.conditions[?(@.type=="RolloutRefused")].message}'; echo
kubectl -n demo get events --field-selector reason=RolloutRefused
cat <<MSG

The demo cluster stays up. In another shell:
  export KUBECONFIG=$KUBECONFIG
  kubectl get infd -A -w
  kubectl -n demo describe infd incident
Press Ctrl-C to stop everything.
MSG
wait $cluster
