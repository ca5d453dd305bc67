//! The operator process itself: a restart mid-rollout resumes without duplicate work, a
//! reconcile with nothing changed writes nothing, fields of owned objects changed by hand are put
//! back (by a running and by a restarted operator), and of two replicas only the leader writes.
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
fn fields_of_owned_objects_changed_by_hand_are_put_back_by_this_operator_and_a_restarted_one() {
    let cp = cluster();
    let ns = cp.restricted_namespace("drift");
    let first = Operator::start_in(cp, "operator-drift-1", "lease-drift", Some(&ns));
    apply_yaml(cp, &ns, &tiny("llm", 256, 1024, 1024, ""));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "llm")["status"]["phase"] == "Available");
    let decode = get_json(cp, &["-n", &ns, "get", "deployments", "-l", "app.kubernetes.io/component=decode"])["items"][0]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let replicas = |cp: &ControlPlane| get_json(cp, &["-n", &ns, "get", "deployment", &decode])["spec"]["replicas"].clone();
    let selector = |cp: &ControlPlane| get_json(cp, &["-n", &ns, "get", "service", "llm"])["spec"]["selector"]["app.kubernetes.io/component"].clone();
    let (want_replicas, want_selector) = (replicas(cp), selector(cp));

    // Changed by hand (each field's owner becomes the editor): the watch's digest of what the
    // operator owns no longer matches, and the next apply puts each field back.
    let drift = |cp: &ControlPlane| {
        cp.kubectl_ok(&["-n", &ns, "scale", "deployment", &decode, "--replicas=3"]);
        cp.kubectl_ok(&["-n", &ns, "patch", "service", "llm", "--type=merge", "-p", r#"{"spec":{"selector":{"app.kubernetes.io/component":"elsewhere"}}}"#]);
    };
    drift(cp);
    eventually(cp, &ns, "the scaled Deployment and the edited Service put back", LONG, || replicas(cp) == want_replicas && selector(cp) == want_selector);

    // The same with the edits made while no operator runs: a new one learns them from its first
    // list, with nothing remembered of its own applies.
    drop(first);
    drift(cp);
    let _second = Operator::start_in(cp, "operator-drift-2", "lease-drift", Some(&ns));
    eventually(cp, &ns, "put back by the restarted operator", LONG, || replicas(cp) == want_replicas && selector(cp) == want_selector);
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
    // b is warm: its watches have listed, its index holds the deployment, and it runs nothing.
    // A cold standby (c) holds nothing until it leads.
    let c = Operator::start_with(cp, "operator-c", "lease-ha", Some(&ns), &["--cold-standby"]);
    eventually(cp, &ns, "operator-b's watches listed", Duration::from_secs(30), || b.metric("kvgate_operator_watches_synced") == Some(1.0));
    assert_eq!(b.metric("kvgate_operator_indexed_deployments"), Some(1.0), "the warm standby's index");
    let tasks = |op: &Operator| kvgate_testenv::metrics::family_sum(&get(&op.metrics).unwrap_or_default(), "kvgate_operator_background_tasks");
    assert_eq!(tasks(&b), 0.0, "the warm standby runs no task");
    assert!(tasks(&a) > 0.0, "the leader runs its scrapes and serving probes");
    assert_eq!((c.metric("kvgate_operator_watches_synced"), c.metric("kvgate_operator_indexed_deployments")), (Some(0.0), Some(0.0)));
    assert_eq!((leader(&c), reconciles(&c)), (0.0, 0.0));
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
    assert_eq!(leader(&c), 0.0, "the cold standby stays a standby while b leads");
}

/// The handoff Secret(s) of a deployment by name.
fn secrets_of(cp: &ControlPlane, ns: &str, name: &str) -> Vec<String> {
    let list = get_json(cp, &["-n", ns, "get", "secrets", "-l", &format!("app.kubernetes.io/instance={name}")]);
    list["items"].as_array().into_iter().flatten().filter_map(|s| s["metadata"]["name"].as_str().map(String::from)).collect()
}

#[test]
fn a_deleted_deployment_leaves_no_series_and_a_namesake_starts_like_a_first_creation() {
    let cp = cluster();
    let ns = cp.restricted_namespace("recreate");
    let op = Operator::start_in(cp, "operator-recreate", "lease-recreate", Some(&ns));
    apply_yaml(cp, &ns, &tiny("llm", 256, 1024, 1024, ""));
    // A window no pool here holds: refused, which sets the series an alert fires on.
    apply_yaml(cp, &ns, &tiny("bad", 1_000_000, 1024, 1024, ""));
    eventually(cp, &ns, "llm Available and bad Refused", LONG, || {
        infd(cp, &ns, "llm")["status"]["phase"] == "Available" && infd(cp, &ns, "bad")["status"]["phase"] == "Refused"
    });
    let refused = format!(r#"kvgate_operator_rollout_refused{{name="bad",namespace="{ns}",reason="KVPoolBelowContextWindow"}}"#);
    assert_eq!(op.metric(&refused), Some(1.0));
    assert!(op.series_of(&ns, "llm").iter().any(|l| l.starts_with("kvgate_operator_kv_pool_capacity_tokens")), "{:?}", op.series_of(&ns, "llm"));
    let first_uid = infd(cp, &ns, "llm")["metadata"]["uid"].as_str().unwrap().to_string();
    let first_secret = secrets_of(cp, &ns, "llm");
    assert_eq!(first_secret.len(), 1, "{first_secret:?}");

    assert_eq!(op.metric("kvgate_operator_indexed_deployments"), Some(2.0));
    cp.kubectl_ok(&["-n", &ns, "delete", "infd", "llm", "bad", "--wait=true", "--timeout=60s"]);
    eventually(cp, &ns, "every series of the deleted deployments gone", Duration::from_secs(30), || {
        op.series_of(&ns, "bad").is_empty() && op.series_of(&ns, "llm").is_empty()
    });
    assert_eq!(op.metric(&refused), None, "KvgateRolloutRefused would fire forever");

    // Deletes that land mid-reconcile: each deployment is deleted the moment it is created,
    // while the passes its creation started still write its objects and status.
    for i in 0..6 {
        let name = format!("churn{i}");
        apply_yaml(cp, &ns, &tiny(&name, 256, 1024, 1024, ""));
        cp.kubectl_ok(&["-n", &ns, "delete", "infd", &name, "--wait=false"]);
    }
    eventually(cp, &ns, "the index, every task and every series of the deleted deployments gone", Duration::from_secs(60), || {
        let text = get(&op.metrics).unwrap_or_default();
        let tasks: f64 =
            text.lines().filter(|l| l.starts_with("kvgate_operator_background_tasks{")).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum();
        op.metric("kvgate_operator_indexed_deployments") == Some(0.0) && tasks == 0.0 && (0..6).all(|i| op.series_of(&ns, &format!("churn{i}")).is_empty())
    });
    // And they stay gone: a late pass or task of a deleted UID puts nothing back.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(op.metric("kvgate_operator_indexed_deployments"), Some(0.0));
    assert!((0..6).all(|i| op.series_of(&ns, &format!("churn{i}")).is_empty()), "{}", get(&op.metrics).unwrap_or_default());
    assert!(get_json(cp, &["-n", &ns, "get", "infd"])["items"].as_array().unwrap().is_empty());

    // The same manifest again: a first creation in every way, with a Secret of its own.
    apply_yaml(cp, &ns, &tiny("llm", 256, 1024, 1024, ""));
    eventually(cp, &ns, "the namesake Available", LONG, || infd(cp, &ns, "llm")["status"]["phase"] == "Available");
    let d = infd(cp, &ns, "llm");
    assert_ne!(d["metadata"]["uid"].as_str().unwrap(), first_uid);
    eventually(cp, &ns, "only the namesake's Secret left (the old one collected with its owner)", Duration::from_secs(60), || {
        let now = secrets_of(cp, &ns, "llm");
        now.len() == 1 && now != first_secret
    });
    let router = router_endpoints(cp, &ns, "llm").pop().expect("a ready router");
    assert_eq!(complete(&router, "Hello", 4).map(|r| r.0), Some(200));
    let pods = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/instance=llm"]);
    for p in pods["items"].as_array().unwrap() {
        assert_eq!(p["metadata"]["labels"]["kvgate.dev/deployment-uid"], d["metadata"]["uid"], "{}", p["metadata"]["name"]);
    }
}

#[test]
fn a_pod_that_cannot_start_is_named_in_status_and_a_deleted_handoff_secret_comes_back() {
    let cp = cluster();
    let ns = cp.restricted_namespace("stuck");
    let _op = Operator::start_in(cp, "operator-stuck", "lease-stuck", Some(&ns));
    // An image the registry does not have: the pods never start, and status says so in the
    // pods' own words (the node's pull error, then its back-off, as a kubelet alternates them).
    apply_yaml(cp, &ns, &with_image(&tiny("llm", 256, 1024, 1024, ""), "ghcr.io/kvgate/kvgate-worker-nowhere:0.1.0"));
    // Pods fail to pull one by one: wait until status names one of each role, as it must.
    eventually(cp, &ns, "Progressing naming the prefill and decode pods that cannot start", LONG, || {
        condition(&infd(cp, &ns, "llm"), "Progressing").is_some_and(|c| {
            let message = c["message"].as_str().unwrap_or_default();
            c["reason"] == "PodsCannotStart" && message.contains("llm-prefill-") && message.contains("llm-decode-")
        })
    });
    let d = infd(cp, &ns, "llm");
    let message = condition(&d, "Progressing").unwrap()["message"].as_str().unwrap().to_string();
    assert!(
        (message.contains("cannot start: ErrImagePull") || message.contains("cannot start: ImagePullBackOff"))
            && message.contains("llm-prefill-")
            && message.contains("kvgate-worker-nowhere")
            && message.contains("manifest unknown"),
        "{message}"
    );
    // The user's first question, answered with the registry's own words.
    let (_, why) = kubectl_kvgate(cp, &["why", "llm", "-n", &ns]);
    assert!(why.contains("waiting ImagePullBackOff: Back-off pulling image") || why.contains("waiting ErrImagePull: Failed to pull image"), "{why}");
    assert!(why.contains("manifest unknown") && why.contains("image pull"), "{why}");
    assert_eq!(condition(&d, "Available").unwrap()["reason"], "PodsCannotStart", "{d}");
    assert_eq!(d["status"]["phase"], "Progressing", "no canary runs on pods that never started: {d}");

    // Fixed: a new revision that starts and serves.
    apply_yaml(cp, &ns, &tiny("llm", 256, 1024, 1024, ""));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "llm")["status"]["phase"] == "Available");

    // Someone deletes the handoff Secret; a prefill pod restarts and cannot mount it. The
    // operator learns it from the pod and creates the Secret again; serving recovers.
    let secret = secrets_of(cp, &ns, "llm").pop().unwrap();
    cp.kubectl_ok(&["-n", &ns, "delete", "secret", &secret]);
    cp.kubectl_ok(&["-n", &ns, "delete", "pod", "-l", "app.kubernetes.io/component=prefill", "--wait=false"]);
    eventually(cp, &ns, "the Secret created again and the new prefill pod verified and Ready", LONG, || {
        let d = infd(cp, &ns, "llm");
        secrets_of(cp, &ns, "llm") == [secret.clone()] && d["status"]["prefill"]["readyReplicas"] == 1 && !condition_true(&d, "Degraded")
    });
    // The router was unready while it had no prefill peer; its probe (every 2 s) and the
    // EndpointSlice follow the new prefill pod a moment later.
    let router = ready_router(cp, &ns, "llm", LONG);
    eventually(cp, &ns, "a completion through the recovered deployment", Duration::from_secs(30), || complete(&router, "Hello", 4).is_some_and(|r| r.0 == 200));
}

#[test]
fn every_log_line_of_the_operator_and_its_pods_is_json_and_none_is_coloured() {
    let cp = cluster();
    let ns = cp.restricted_namespace("logs");
    let op = Operator::start_with(cp, "operator-logs", "lease-logs", Some(&ns), &["--log-format=json"]);
    apply_yaml(cp, &ns, &tiny("llm", 256, 1024, 1024, ""));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "llm")["status"]["phase"] == "Available");
    let router = router_endpoints(cp, &ns, "llm").pop().expect("a ready router");
    assert_eq!(complete(&router, "Hello", 4).map(|r| r.0), Some(200));
    let json_lines = |what: &str, text: &str| {
        assert!(!text.contains('\x1b'), "{what}: colour escapes in {text:?}");
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        assert!(!lines.is_empty(), "{what}: no log lines");
        for line in lines {
            let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{what}: not a JSON line ({e}): {line}"));
            assert!(v["level"].is_string() && v["message"].is_string() && v["timestamp"].is_string(), "{what}: {line}");
        }
    };
    json_lines("the operator", &std::fs::read_to_string(&op.proc.log).unwrap());
    // Worker pods log JSON by default (the operator renders --log-format=json), read through the
    // API server and the node agent's kubelet port as `kubectl logs` reads them.
    for role in ["router", "prefill", "decode"] {
        let logs = cp.kubectl_ok(&["-n", &ns, "logs", "-l", &format!("app.kubernetes.io/instance=llm,app.kubernetes.io/component={role}"), "--tail=-1"]);
        json_lines(role, &logs);
        // The router's access line of the completion carries its trace and request ids.
        if role == "router" {
            let answered = logs.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()).find(|v| v["message"] == "request answered");
            let answered = answered.unwrap_or_else(|| panic!("no access line in the router's logs:\n{logs}"));
            assert!(answered["trace_id"].as_str().is_some_and(|t| t.len() == 32) && answered["request_id"].is_string(), "{answered}");
            assert_eq!(answered["status"], 200, "{answered}");
        }
    }
    // Text logs off a terminal: plain lines, no escapes.
    drop(op);
    let text = Operator::start_with(cp, "operator-logs-text", "lease-logs", Some(&ns), &["--log-format=text"]);
    eventually(cp, &ns, "the text operator reconciling", LONG, || text.metric(r#"kvgate_operator_reconcile_total{result="success"}"#).unwrap_or(0.0) >= 1.0);
    let log = std::fs::read_to_string(&text.proc.log).unwrap();
    assert!(log.contains("kvgate-operator: metrics on http://") && !log.contains('\x1b'), "{log:?}");
}
