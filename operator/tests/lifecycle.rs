//! The operator process itself: a restart mid-rollout resumes without duplicate work, a
//! reconcile with nothing changed writes nothing, and of two replicas only the leader writes.
//! Each test runs its own operators (on their own Lease, watching only the test's namespace)
//! against the shared control plane.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use kvgate_testenv::ControlPlane;
use support::*;

const LONG: Duration = Duration::from_secs(120);

/// name -> resourceVersion of everything the deployment owns, and the deployment itself.
fn versions(cp: &ControlPlane, ns: &str, name: &str) -> BTreeMap<String, String> {
    let owned = get_json(
        cp,
        &["-n", ns, "get", "deployments,services,serviceaccounts,roles,rolebindings,secrets", "-l", &format!("app.kubernetes.io/instance={name}")],
    );
    let mut out: BTreeMap<String, String> = owned["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|o| {
            (
                format!("{}/{}", o["kind"].as_str().unwrap(), o["metadata"]["name"].as_str().unwrap()),
                o["metadata"]["resourceVersion"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    out.insert("InferenceDeployment".into(), infd(cp, ns, name)["metadata"]["resourceVersion"].as_str().unwrap().to_string());
    out
}

fn events(cp: &ControlPlane, ns: &str, reason: &str) -> i64 {
    let evs = get_json(cp, &["-n", ns, "get", "events", &format!("--field-selector=reason={reason}")]);
    evs["items"].as_array().into_iter().flatten().map(|e| e["series"]["count"].as_i64().unwrap_or(e["count"].as_i64().unwrap_or(1))).sum()
}

#[test]
fn a_restart_mid_rollout_resumes_without_duplicates_and_an_idle_reconcile_writes_nothing() {
    let cp = cluster();
    let ns = cp.restricted_namespace("restart");
    let mut first = Operator::start_in(cp, "operator-restart-1", "lease-restart", Some(&ns));
    apply_yaml(cp, &ns, &tiny("llm", 256, 1024, 1024, ""));
    // Mid-rollout: the candidate's pods exist, nothing is verified yet.
    eventually(cp, &ns, "the candidate's Deployments", LONG, || {
        get_json(cp, &["-n", &ns, "get", "deployments", "-l", "kvgate.dev/revision"])["items"].as_array().is_some_and(|a| a.len() == 2)
    });
    first.proc.stop();
    let second = Operator::start_in(cp, "operator-restart-2", "lease-restart", Some(&ns));
    eventually(cp, &ns, "Available after the restart", LONG, || infd(cp, &ns, "llm")["status"]["phase"] == "Available");
    let deps = get_json(cp, &["-n", &ns, "get", "deployments", "-l", "kvgate.dev/revision"]);
    assert_eq!(deps["items"].as_array().unwrap().len(), 2, "{deps}");
    let pods = get_json(cp, &["-n", &ns, "get", "pods"]);
    assert_eq!(pods["items"].as_array().unwrap().len(), 3, "one router, one prefill, one decode: {pods}");
    assert_eq!(events(cp, &ns, "RolloutVerified"), 1, "the revision was promoted more than once");
    let secrets = get_json(cp, &["-n", &ns, "get", "secrets", "-l", "app.kubernetes.io/instance=llm"]);
    assert_eq!(secrets["items"].as_array().unwrap().len(), 1);

    // Settled: a fresh operator reconciles everything again and writes nothing.
    std::thread::sleep(Duration::from_secs(3));
    let before = versions(cp, &ns, "llm");
    let handoff_secret = get_json(cp, &["-n", &ns, "get", "secret", "llm-handoff"])["data"]["secret"].clone();
    drop(second);
    let third = Operator::start_in(cp, "operator-restart-3", "lease-restart", Some(&ns));
    let reconciled = |op: &Operator| op.metric(r#"kvgate_operator_reconcile_total{result="success"}"#).unwrap_or(0.0);
    eventually(cp, &ns, "reconciles by the new operator", LONG, || reconciled(&third) >= 2.0);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(versions(cp, &ns, "llm"), before, "an idle reconcile wrote to the API server");
    assert_eq!(get_json(cp, &["-n", &ns, "get", "secret", "llm-handoff"])["data"]["secret"], handoff_secret, "the handoff secret was regenerated");
}

#[test]
fn of_two_replicas_only_the_leader_reconciles_and_the_other_takes_over() {
    let cp = cluster();
    let ns = cp.restricted_namespace("leader");
    let a = Operator::start_in(cp, "operator-a", "lease-ha", Some(&ns));
    std::thread::sleep(Duration::from_secs(1));
    let b = Operator::start_in(cp, "operator-b", "lease-ha", Some(&ns));
    apply_yaml(cp, &ns, &tiny("ha", 256, 1024, 1024, ""));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "ha")["status"]["phase"] == "Available");
    let leader = |op: &Operator| op.metric("kvgate_operator_leader").unwrap_or(-1.0);
    let reconciles = |op: &Operator| op.metric(r#"kvgate_operator_reconcile_total{result="success"}"#).unwrap_or(0.0);
    assert_eq!((leader(&a), leader(&b)), (1.0, 0.0));
    assert!(reconciles(&a) > 0.0);
    assert_eq!(reconciles(&b), 0.0, "the standby reconciled");
    let lease = get_json(cp, &["-n", "default", "get", "lease", "lease-ha"]);
    assert_eq!(lease["spec"]["holderIdentity"], "operator-a");

    // The leader goes away (releasing the Lease); the standby takes over and reconciles.
    drop(a);
    eventually(cp, &ns, "operator-b leading", Duration::from_secs(30), || leader(&b) == 1.0);
    apply_yaml(cp, &ns, &tiny("ha", 256, 1024, 1024, "").replace("  decode:\n    replicas: 1", "  decode:\n    replicas: 2"));
    eventually(cp, &ns, "the scale-up handled by operator-b", LONG, || {
        let d = infd(cp, &ns, "ha");
        d["status"]["decode"]["readyReplicas"] == 2 && d["status"]["phase"] == "Available"
    });
    assert!(reconciles(&b) > 0.0);
}
