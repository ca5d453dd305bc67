//! Settled deployments: an idle operator asks the API server nothing, and a burst through the
//! pods is answered whole. With 10 InferenceDeployments settled (3 serving, each with a router,
//! a prefill and a decode pod and a gateway's InferencePool, whose CRD is installed; 7 with no
//! pods), the API server's own audit log shows no GET or
//! LIST from the operator or any router over 60 s (nothing at all but the leader Lease's
//! renewals), and every reconcile pass in that window took under 1 s; then 16 requests at once
//! through one router all get the same answer. The control plane of this binary writes the
//! audit log (`Options::audit`), so this test has a binary of its own; `make bench` measures
//! the same at 1,010 deployments (`operator/benches/operator.rs`).

mod support;

use std::time::Duration;

use kvgate_testenv::audit::Request;
use support::*;

const QUIET: Duration = Duration::from_secs(60);

#[test]
fn an_idle_operator_and_its_routers_send_no_get_or_list_every_pass_is_short_and_a_burst_is_served() {
    kvgate_testenv::ControlPlane::shared_with(kvgate_testenv::Options { crds: true, audit: true });
    let cp = cluster();
    let op = Operator::start(cp, "operator-idle");
    let ns = cp.restricted_namespace("idle");
    // The pools' CRD served: they are watched, not read per pass.
    cp.kubectl_ok(&["apply", "-f", repo("tests/fixtures/inferencepool-crd.yaml").to_str().unwrap()]);
    cp.kubectl_ok(&["wait", "--for=condition=Established", "crd/inferencepools.inference.networking.k8s.io", "--timeout=30s"]);
    let serving: String = (0..3)
        .map(|i| tiny(&format!("live{i}"), 256, 1024, 1024, "") + &format!("  inferencePool:\n    endpointPicker: {{ name: live{i}-epp }}\n---\n"))
        .collect();
    let idle: String =
        (0..7).map(|i| tiny(&format!("idle{i}"), 256, 1024, 1024, "").replace("replicas: 1", "replicas: 0") + "  router: { replicas: 0 }\n---\n").collect();
    apply_yaml(cp, &ns, &(serving + &idle));
    eventually(cp, &ns, "every status written, the serving ones Available with their pools", Duration::from_secs(300), || {
        let list = get_json(cp, &["-n", &ns, "get", "infd"]);
        list["items"].as_array().is_some_and(|a| {
            a.len() == 10
                && a.iter().all(|d| {
                    let name = d["metadata"]["name"].as_str().unwrap_or_default();
                    d["status"]["observedGeneration"].is_number()
                        && (!name.starts_with("live") || (d["status"]["phase"] == "Available" && condition_true(d, "InferencePoolReady")))
                })
        })
    });
    // The last status writes and the canaries' tasks end; then nothing changes.
    std::thread::sleep(Duration::from_secs(5));

    let reconciles = || {
        let count = op.metric("kvgate_operator_reconcile_duration_seconds_count").unwrap_or(0.0);
        let under_a_second = op.metric(r#"kvgate_operator_reconcile_duration_seconds_bucket{le="1"}"#).unwrap_or(0.0);
        (count, under_a_second)
    };
    let before = reconciles();
    let from = k8s_openapi::jiff::Timestamp::now();
    std::thread::sleep(QUIET);
    let to = k8s_openapi::jiff::Timestamp::now();
    let after = reconciles();

    let requests = kvgate_testenv::audit::requests(&cp.audit_log(), from, to);
    let ours = |r: &&Request| r.user_agent.starts_with("kvgate-operator/") || r.user_agent.starts_with("kvgate-router/");
    // The leader's Lease is renewed every few seconds (this operator runs with leader election,
    // as the chart's replicas do); nothing else is asked (no GET, no LIST) or written.
    let others: Vec<&Request> = requests.iter().filter(ours).filter(|r| r.resource != "leases").collect();
    let mut by_verb = std::collections::BTreeMap::<String, usize>::new();
    for r in requests.iter().filter(ours) {
        *by_verb.entry(format!("{} {} ({})", r.verb, r.resource, r.user_agent.split('/').next().unwrap_or_default())).or_default() += 1;
    }
    // The filter must match something, or an empty or unparsed audit log would pass: the
    // leader's own renewals are in it.
    let renewals = requests.iter().filter(ours).filter(|r| r.resource == "leases").count();
    assert!(renewals > 0, "no Lease renewal by kvgate-operator/ among the {} audited requests of the quiet minute: the filter matched nothing", requests.len());
    let passes = after.0 - before.0;
    eprintln!("idle for {QUIET:?}: requests from the operator and the routers {by_verb:?}; {passes} reconcile passes");
    assert!(others.is_empty(), "GET, LIST or writes besides the Lease's renewals while nothing changed: {others:#?}");
    assert_eq!(after.1 - before.1, passes, "a reconcile pass in the quiet minute took 1 s or more");

    // Then a burst through the pods: 16 requests at once (one client's share in flight at the
    // router), so 16 handoffs at once from the one prefill pod's address into decode's KV port,
    // twice the strangers' share per address there: every one answered, with the same text.
    let router = router_endpoints(cp, &ns, "live0").pop().unwrap();
    let reference = completion_text(&complete(&router, "Hello", 6).unwrap().1).unwrap();
    let burst: Vec<(u16, String)> = std::thread::scope(|s| {
        let calls: Vec<_> = (0..16).map(|_| s.spawn(|| complete(&router, "Hello", 6).expect("the router answers"))).collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    });
    assert_eq!(never_wrong(&burst, &reference), (16, 0), "a burst of 16 through the pods: {burst:?}");
    cp.kubectl_ok(&["delete", "namespace", &ns, "--wait=false"]);
}
