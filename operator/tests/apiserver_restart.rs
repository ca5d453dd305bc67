//! kube-apiserver restarted in the middle of a rollout (its own test binary: every client of this
//! control plane sees its connections and watches drop). The operator's watches resume, the
//! rollout completes once, and later changes are still seen; the router's EndpointSlice watch
//! resumes too.

mod support;

use std::time::Duration;

use support::*;

const LONG: Duration = Duration::from_secs(180);

#[test]
fn a_rollout_survives_a_kube_apiserver_restart() {
    let cp = cluster();
    let ns = cp.restricted_namespace("apiserver");
    let op = Operator::start_in(cp, "operator-apiserver", "lease-apiserver", Some(&ns));
    apply_yaml(cp, &ns, &tiny("llm", 256, 1024, 1024, ""));
    eventually(cp, &ns, "the candidate's Deployments", LONG, || {
        get_json(cp, &["-n", &ns, "get", "deployments", "-l", "kvgate.dev/revision"])["items"].as_array().is_some_and(|a| a.len() == 2)
    });
    cp.restart_apiserver().unwrap_or_else(|e| panic!("restarting kube-apiserver: {e:#}"));
    eventually(cp, &ns, "Available after the restart", LONG, || infd(cp, &ns, "llm")["status"]["phase"] == "Available");
    assert_eq!(events(cp, &ns, "RolloutVerified"), 1, "promoted more than once");
    let router = router_endpoints(cp, &ns, "llm").pop().expect("a ready router");
    eventually(cp, &ns, "a completion through the router", Duration::from_secs(30), || complete(&router, "Hello", 4).is_some_and(|r| r.0 == 200));

    // Watches resumed: a change after the restart is seen and carried out.
    apply_yaml(cp, &ns, &tiny("llm", 256, 1024, 1024, "").replace("  decode:\n    replicas: 1", "  decode:\n    replicas: 2"));
    eventually(cp, &ns, "two decode pods ready", LONG, || infd(cp, &ns, "llm")["status"]["decode"]["readyReplicas"] == 2);
    assert!(op.metric(r#"kvgate_operator_reconcile_total{result="success"}"#).unwrap_or(0.0) > 0.0);
    assert_eq!(op.metric("kvgate_operator_leader"), Some(1.0), "the operator kept (or took back) its Lease");
}
