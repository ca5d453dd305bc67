//! An idle operator asks the API server nothing: with 10 InferenceDeployments settled (3
//! serving, each with a router, a prefill and a decode pod; 7 with no pods), the API server's
//! own audit log shows no GET or LIST from the operator or any router over 60 s, and every
//! reconcile pass in that window took under 1 s. The control plane of this binary writes the
//! audit log (`Options::audit`), so this test has a binary of its own; `make bench` measures
//! the same at 1,010 deployments (`operator/benches/operator.rs`).

mod support;

use std::time::Duration;

use kvgate_testenv::audit::Request;
use support::*;

const QUIET: Duration = Duration::from_secs(60);

#[test]
fn an_idle_operator_and_its_routers_send_no_get_or_list_and_every_pass_is_short() {
    kvgate_testenv::ControlPlane::shared_with(kvgate_testenv::Options { crds: true, audit: true });
    let cp = cluster();
    let op = Operator::start(cp, "operator-idle");
    let ns = cp.restricted_namespace("idle");
    let serving: String = (0..3).map(|i| tiny(&format!("live{i}"), 256, 1024, 1024, "") + "---\n").collect();
    let idle: String =
        (0..7).map(|i| tiny(&format!("idle{i}"), 256, 1024, 1024, "").replace("replicas: 1", "replicas: 0") + "  router: { replicas: 0 }\n---\n").collect();
    apply_yaml(cp, &ns, &(serving + &idle));
    eventually(cp, &ns, "every status written, the serving ones Available", Duration::from_secs(300), || {
        let list = get_json(cp, &["-n", &ns, "get", "infd"]);
        list["items"].as_array().is_some_and(|a| {
            a.len() == 10
                && a.iter().all(|d| {
                    let name = d["metadata"]["name"].as_str().unwrap_or_default();
                    d["status"]["observedGeneration"].is_number() && (!name.starts_with("live") || d["status"]["phase"] == "Available")
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
    // The leader Lease is renewed with a GET and an update when the chart runs replicas with
    // leader election; this operator runs alone, and a Lease read would be counted apart.
    let reads: Vec<&Request> = requests.iter().filter(ours).filter(|r| matches!(r.verb.as_str(), "get" | "list") && r.resource != "leases").collect();
    let from_us = requests.iter().filter(ours).count();
    let passes = after.0 - before.0;
    eprintln!("idle for {QUIET:?}: {from_us} requests from the operator and the routers, {} GET/LIST; {passes} reconcile passes", reads.len());
    assert!(reads.is_empty(), "GET or LIST while nothing changed: {reads:#?}");
    assert_eq!(after.1 - before.1, passes, "a reconcile pass in the quiet minute took 1 s or more");
    cp.kubectl_ok(&["delete", "namespace", &ns, "--wait=false"]);
}
