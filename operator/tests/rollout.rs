//! End to end on a real control plane: the operator deploys real worker processes, verifies
//! their measured KV pools, serves from verified revisions only, and refuses the incident.

mod support;

use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use kvgate_testenv::ControlPlane;
use support::*;

fn env() -> (&'static ControlPlane, &'static Operator) {
    static OP: OnceLock<Operator> = OnceLock::new();
    let cp = cluster();
    (cp, OP.get_or_init(|| Operator::start(cp, "operator")))
}

const LONG: Duration = Duration::from_secs(120);

#[test]
fn the_incident_is_refused_with_both_numbers_and_never_available() {
    let (cp, op) = env();
    let ns = cp.restricted_namespace("incident");
    let refused_before = op.metric(r#"kvgate_operator_rollouts_refused_total{reason="KVPoolBelowContextWindow"}"#).unwrap_or(0.0);
    cp.kubectl_ok(&["-n", &ns, "apply", "-f", repo("examples/incident.yaml").to_str().unwrap()]);
    eventually(cp, &ns, "RolloutRefused", LONG, || condition_true(&infd(cp, &ns, "incident"), "RolloutRefused"));
    let d = infd(cp, &ns, "incident");
    let msg = condition(&d, "RolloutRefused").unwrap()["message"].as_str().unwrap().to_string();
    // The pool is measured under the pod's 256Mi limit: whatever it holds, it is below the window.
    let measured: u64 = msg.split("measured ").nth(1).and_then(|m| m.split(' ').next()).and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{msg}"));
    assert!(measured > 0 && measured < 1048576 && (measured as f64) < 0.9 * 256.0 * 1048576.0 / 256.0, "{msg}");
    assert!(msg.contains(&format!("measured {measured} tokens < contextWindow 1048576")) && msg.contains("prefill pod incident-prefill-"), "{msg}");
    assert_eq!(condition(&d, "RolloutRefused").unwrap()["reason"], "KVPoolBelowContextWindow");
    assert_eq!(condition(&d, "Available").unwrap()["status"], "False", "{d}");
    assert!(condition(&d, "Available").unwrap()["message"].as_str().unwrap().contains(&measured.to_string()), "{d}");
    assert_eq!((d["status"]["phase"].as_str(), d["status"]["reason"].as_str()), (Some("Refused"), Some("KVPoolBelowContextWindow")));
    assert_eq!(d["status"]["prefill"]["minMeasuredTokens"], measured, "{d}");
    // What a user runs first: the real kubectl finds the plugin, which names both numbers and
    // what to change; the table shows the reason.
    let wants = [
        "incident (kvgate engine, contextWindow 1048576): Refused (KVPoolBelowContextWindow)".to_string(),
        format!("measured {measured} tokens < contextWindow 1048576"),
        format!("smallest measured pools: prefill {measured}"),
        "Warning RolloutRefused".to_string(),
        format!("or lower spec.contextWindow to at most {measured}"),
    ];
    why_says(cp, &ns, "incident", 1, &wants);
    let (code, list) = kubectl_kvgate(cp, &["list", "-n", &ns]);
    assert_eq!(code, 0, "{list}");
    let row: Vec<&str> = list.lines().nth(1).unwrap_or_default().split_whitespace().collect();
    assert_eq!((row.get(1), row.get(7), row.get(8)), (Some(&"incident"), Some(&"Refused"), Some(&"KVPoolBelowContextWindow")), "{list}");
    let table = cp.kubectl_ok(&["-n", &ns, "get", "infd", "incident"]);
    assert!(table.lines().nth(1).is_some_and(|r| r.contains("Refused") && r.contains("KVPoolBelowContextWindow")), "{table}");
    let (code, missing) = kubectl_kvgate(cp, &["why", "nothing-here", "-n", &ns]);
    assert!(code == 2 && missing.contains("no InferenceDeployment nothing-here in namespace"), "{missing}");
    assert!(d["status"]["currentRevision"].is_null());
    // The Warning Event and the metric.
    eventually(cp, &ns, "a RolloutRefused Event", Duration::from_secs(30), || {
        let evs = get_json(cp, &["-n", &ns, "get", "events", "--field-selector=reason=RolloutRefused"]);
        evs["items"].as_array().is_some_and(|a| {
            a.iter().any(|e| e["type"] == "Warning" && e["message"].as_str().unwrap_or("").contains(&format!("{measured} tokens < contextWindow 1048576")))
        })
    });
    assert!(op.metric(r#"kvgate_operator_rollouts_refused_total{reason="KVPoolBelowContextWindow"}"#).unwrap() >= refused_before + 1.0);
    // Its pods are scaled away, and none was ever Ready: nothing could have routed to them.
    eventually(cp, &ns, "the refused pods gone", LONG, || {
        get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/component in (prefill,decode)"])["items"].as_array().is_some_and(|a| a.is_empty())
    });
    // Stays refused: no retry of the same revision.
    std::thread::sleep(Duration::from_secs(3));
    let d = infd(cp, &ns, "incident");
    assert_eq!(d["status"]["phase"], "Refused");
    let evs = get_json(cp, &["-n", &ns, "get", "events", "--field-selector=reason=RolloutRefused"]);
    let count: i64 = evs["items"].as_array().unwrap().iter().map(|e| e["count"].as_i64().unwrap_or(1).max(e["series"]["count"].as_i64().unwrap_or(1))).sum();
    assert_eq!(count, 1, "the refusal was reported more than once: {evs}");
    // Its router has no verified peers: not ready, but alive, so it is never restarted for it.
    let ip = pod_ips(cp, &ns, "router").pop().expect("the incident's router pod");
    assert_eq!(request("GET", &format!("http://{ip}:8080/healthz"), None).map(|r| r.0), Some(200));
    assert_eq!(request("GET", &format!("http://{ip}:8080/readyz"), None).map(|r| r.0), Some(503));
    let routers = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/component=router"]);
    for p in routers["items"].as_array().unwrap() {
        assert_eq!(p["status"]["containerStatuses"][0]["restartCount"], 0, "the router was restarted: {p}");
    }
}

#[test]
fn the_internal_api_and_kv_port_of_a_deployment_refuse_outsiders_in_the_cluster() {
    let (cp, _) = env();
    let ns = cp.restricted_namespace("guarded");
    apply_yaml(cp, &ns, &tiny("guarded", 256, 1024, 1024, ""));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "guarded")["status"]["phase"] == "Available");
    // The prefill pods timed two prompts at start: the window fits the handoff timeout.
    let fits = condition(&infd(cp, &ns, "guarded"), "PrefillWithinHandoffTimeout").cloned().unwrap_or_default();
    assert_eq!((fits["status"].as_str(), fits["reason"].as_str()), (Some("True"), Some("WithinHandoffTimeout")), "{fits}");
    assert!(fits["message"].as_str().unwrap().contains("measured 128 tokens in"), "{fits}");
    let (decode, prefill) = (pod_ips(cp, &ns, "decode").pop().unwrap(), pod_ips(cp, &ns, "prefill").pop().unwrap());
    // Anyone who reaches a pod cannot use the internal API without the deployment's secret.
    let (status, body) = request("POST", &format!("http://{decode}:8082/internal/v1/reserve"), Some(r#"{"prompt_tokens":1,"max_tokens":1}"#)).unwrap();
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("unauthenticated"), "{body}");
    let (status, body) = request("POST", &format!("http://{prefill}:8081/internal/v1/prefill"), Some(r#"{"prompt":[1],"reservation":{}}"#)).unwrap();
    assert_eq!(status, 401, "{body}");
    let metric = |ip: &str, port: u16, series: &str| -> f64 {
        let text = get(&format!("http://{ip}:{port}/metrics")).unwrap();
        kvgate_testenv::metrics::sample(&text, series).unwrap_or_else(|| panic!("no {series}"))
    };
    assert_eq!(metric(&decode, 8082, r#"kvgate_internal_requests_rejected_total{reason="missing",role="decode"}"#), 1.0);
    assert_eq!(metric(&prefill, 8081, r#"kvgate_internal_requests_rejected_total{reason="missing",role="prefill"}"#), 1.0);
    // Garbage on decode's KV port is protocol noise: counted as such, never as an integrity event.
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(format!("{decode}:8083")).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut ack = Vec::new();
    let _ = s.read_to_end(&mut ack);
    assert!(String::from_utf8_lossy(&ack).contains("kv_port_malformed"), "{ack:?}");
    assert_eq!(metric(&decode, 8082, r#"kvgate_kv_port_rejected_total{reason="malformed",role="decode"}"#), 1.0);
    let text = get(&format!("http://{decode}:8082/metrics")).unwrap();
    assert_eq!(kvgate_testenv::metrics::family_sum(&text, "kvgate_handoff_mismatch_total"), 0.0);
    // The deployment's own roles, holding the secret, serve as before.
    let router = router_endpoints(cp, &ns, "guarded").pop().unwrap();
    assert_eq!(complete(&router, "Hello", 4).map(|r| r.0), Some(200));
    assert!(condition_true(&infd(cp, &ns, "guarded"), "Available"));
}

#[test]
fn a_host_path_model_is_refused_without_an_allowlist_and_no_pod_is_created() {
    let (cp, op) = env();
    let ns = cp.restricted_namespace("hostpath");
    let yaml = tiny("reader", 256, 1024, 1024, "").replace("model: { name: tiny }", "model: { path: llama, volume: { hostPath: / } }");
    apply_yaml(cp, &ns, &yaml);
    eventually(cp, &ns, "RolloutRefused", LONG, || condition_true(&infd(cp, &ns, "reader"), "RolloutRefused"));
    let d = infd(cp, &ns, "reader");
    let c = condition(&d, "RolloutRefused").unwrap();
    assert_eq!(c["reason"], "HostPathNotAllowed", "{d}");
    let msg = c["message"].as_str().unwrap();
    assert!(msg.contains(r#"hostPath "/""#) && msg.contains("--allowed-host-paths"), "{msg}");
    assert_eq!(d["status"]["phase"], "Refused");
    eventually(cp, &ns, "a RolloutRefused Event", Duration::from_secs(30), || {
        let evs = get_json(cp, &["-n", &ns, "get", "events", "--field-selector=reason=RolloutRefused"]);
        evs["items"].as_array().is_some_and(|a| a.iter().any(|e| e["type"] == "Warning" && e["message"].as_str().unwrap_or("").contains("no pod created")))
    });
    assert!(op.metric(r#"kvgate_operator_rollouts_refused_total{reason="HostPathNotAllowed"}"#).unwrap() >= 1.0);
    std::thread::sleep(Duration::from_secs(2));
    let owned = get_json(cp, &["-n", &ns, "get", "deployments,pods", "-l", "app.kubernetes.io/instance=reader"]);
    assert!(owned["items"].as_array().unwrap().is_empty(), "objects that would mount the node were created: {owned}");
}

#[test]
fn a_good_deployment_serves_a_bad_update_is_refused_without_a_blip_and_a_fix_rolls_forward() {
    let (cp, _) = env();
    let ns = cp.restricted_namespace("rollout");
    apply_yaml(cp, &ns, &tiny("llm", 256, 1024, 1024, ""));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "llm")["status"]["phase"] == "Available");
    let d = infd(cp, &ns, "llm");
    assert!(condition_true(&d, "Available") && condition_true(&d, "CapacityVerified"), "{d}");
    assert!(!condition_true(&d, "RolloutRefused") && !condition_true(&d, "Progressing"), "{d}");
    assert_eq!(d["status"]["decode"]["minMeasuredTokens"], 1024);
    let good = d["status"]["currentRevision"].as_str().unwrap().to_string();
    let router = ready_router(cp, &ns, "llm", LONG);
    let (status, body) = complete(&router, "Hello", 8).expect("router answers");
    assert_eq!(status, 200, "{body}");
    let good_pods = pod_uids(cp, &ns, &good);
    assert_eq!(good_pods.len(), 2);

    // Requests keep flowing through the whole bad update.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let load = {
        let (stop, ok, failed, router) = (stop.clone(), ok.clone(), failed.clone(), router.clone());
        std::thread::spawn(move || {
            let mut errors = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                match complete(&router, "The quick brown fox", 8) {
                    Some((200, _)) => ok.fetch_add(1, Ordering::SeqCst),
                    other => {
                        errors.push(format!("{other:?}"));
                        failed.fetch_add(1, Ordering::SeqCst)
                    }
                };
            }
            errors
        })
    };
    // A bigger window than the pools hold: the new revision is refused.
    apply_yaml(cp, &ns, &tiny("llm", 4096, 1024, 1024, ""));
    eventually(cp, &ns, "the update refused", LONG, || condition_true(&infd(cp, &ns, "llm"), "RolloutRefused"));
    let d = infd(cp, &ns, "llm");
    let bad = d["status"]["refusedRevision"]["revision"].as_str().unwrap().to_string();
    assert_ne!(bad, good);
    assert!(d["status"]["refusedRevision"]["message"].as_str().unwrap().contains("measured 1024 tokens < contextWindow 4096"), "{d}");
    assert_eq!(d["status"]["currentRevision"], good.as_str(), "the serving revision changed");
    assert!(condition_true(&d, "Available"), "the old revision stopped being available: {d}");
    // The refused revision's pods never became Ready, so no EndpointSlice ever offered them.
    for p in get_json(cp, &["-n", &ns, "get", "pods", "-l", &format!("kvgate.dev/revision={bad}")])["items"].as_array().into_iter().flatten() {
        assert!(!condition_true(p, "Ready"), "a refused pod is Ready: {p}");
    }
    eventually(cp, &ns, "the refused revision scaled away", LONG, || pod_uids(cp, &ns, &bad).is_empty());
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::SeqCst);
    let errors = load.join().unwrap();
    assert!(errors.is_empty(), "requests failed during the refused rollout: {errors:?}");
    assert!(ok.load(Ordering::SeqCst) > 0);
    assert_eq!(pod_uids(cp, &ns, &good), good_pods, "the serving pods were replaced or restarted");
    // The router still admits what the serving revision was verified for, and no more.
    let (status, body) = complete(&router, &"x".repeat(300), 4).unwrap();
    assert_eq!(status, 400, "a prompt beyond the verified window was admitted: {body}");

    // Fixing the pools rolls forward; after a short bake the old revision is retired.
    apply_yaml(cp, &ns, &format!("{}  rollout: {{ bakeSeconds: 3 }}\n", tiny("llm", 4096, 8192, 8192, "")));
    eventually(cp, &ns, "the fix rolled out", LONG, || {
        let d = infd(cp, &ns, "llm");
        d["status"]["phase"] == "Available" && d["status"]["currentRevision"] != good.as_str()
    });
    let d = infd(cp, &ns, "llm");
    assert!(!condition_true(&d, "RolloutRefused"), "{d}");
    assert_eq!(d["status"]["currentContextWindow"], 4096);
    eventually(cp, &ns, "old revisions' Deployments deleted", LONG, || {
        let deps = get_json(cp, &["-n", &ns, "get", "deployments", "-l", "kvgate.dev/revision"]);
        deps["items"]
            .as_array()
            .is_some_and(|a| a.len() == 2 && a.iter().all(|x| x["metadata"]["labels"]["kvgate.dev/revision"] == d["status"]["currentRevision"]))
    });
    let mut routers = Vec::new();
    eventually(cp, &ns, "the router on the new window", LONG, || {
        routers = router_endpoints(cp, &ns, "llm");
        routers.iter().any(|r| complete(r, &"x".repeat(300), 4).is_some_and(|(s, _)| s == 200))
    });
}

#[test]
fn prefill_and_decode_with_different_kv_layouts_are_refused() {
    let (cp, _) = env();
    let ns = cp.restricted_namespace("fingerprint");
    apply_yaml(cp, &ns, &tiny("mixed", 256, 1024, 1024, ", dtype: bf16"));
    eventually(cp, &ns, "RolloutRefused", LONG, || condition_true(&infd(cp, &ns, "mixed"), "RolloutRefused"));
    let d = infd(cp, &ns, "mixed");
    let c = condition(&d, "RolloutRefused").unwrap();
    assert_eq!(c["reason"], "FingerprintMismatch", "{d}");
    assert!(c["message"].as_str().unwrap().contains("fingerprints"), "{c}");
    assert_eq!(d["status"]["phase"], "Refused");
}

/// A pod the operator did not make, labelled as the deployment's prefill pod and running a real
/// prefill worker that claims a big pool but holds another deployment's secret, serves a
/// capacity report on its IP that the operator refuses: the MAC does not verify, its gate says
/// `UnauthenticatedReport`, and it never becomes Ready (no traffic can reach it).
#[test]
fn a_report_signed_with_another_secret_does_not_get_a_pod_verified() {
    let (cp, _) = env();
    let ns = cp.restricted_namespace("forged");
    apply_yaml(cp, &ns, &tiny("real", 128, 1024, 1024, ""));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "real")["status"]["phase"] == "Available");
    cp.kubectl_ok(&["-n", &ns, "create", "secret", "generic", "other", "--from-literal=secret=another-deployments-secret-0123456789"]);
    // The real prefill pod, copied: same labels (but the ReplicaSet's hash, or the ReplicaSet would
    // adopt and delete it), spec and readiness gate; another secret, a bigger pool.
    let real = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/component=prefill"])["items"][0].clone();
    let mut labels = real["metadata"]["labels"].clone();
    labels.as_object_mut().unwrap().remove("pod-template-hash");
    let mut fake = serde_json::json!({ "apiVersion": "v1", "kind": "Pod", "metadata": { "name": "forger", "labels": labels }, "spec": real["spec"] });
    for v in fake["spec"]["volumes"].as_array_mut().unwrap() {
        if v["secret"].is_object() {
            v["secret"]["secretName"] = "other".into();
        }
    }
    let args = fake["spec"]["containers"][0]["args"].as_array_mut().unwrap();
    args.retain(|a| !a.as_str().unwrap().starts_with("--kv-pool-tokens"));
    args.push("--kv-pool-tokens=100000".into());
    apply_yaml(cp, &ns, &fake.to_string());

    let gate = || {
        let pod = get_json(cp, &["-n", &ns, "get", "pod", "forger"]);
        pod["status"]["conditions"].as_array().into_iter().flatten().find(|c| c["type"] == "kvgate.dev/kv-pool-verified").cloned()
    };
    eventually(cp, &ns, "the forger's gate condition", LONG, || gate().is_some_and(|c| c["reason"] == "UnauthenticatedReport"));
    let c = gate().unwrap();
    assert_eq!(c["status"], "False", "{c}");
    assert!(c["message"].as_str().unwrap().contains("does not verify as pod forger's"), "{c}");
    // It does serve a report, one that would pass the window check, signed with its own secret.
    let ip = get_json(cp, &["-n", &ns, "get", "pod", "forger"])["status"]["podIP"].as_str().unwrap().to_string();
    let (status, body) = request("GET", &format!("http://{ip}:8081/v1/kv-pool?nonce={}", "ab".repeat(16)), None).unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""capacity_tokens":100000"#), "{body}");
    // Seconds later it is still unverified and not Ready; the deployment's own pods are.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(gate().unwrap()["status"], "False");
    let pod = get_json(cp, &["-n", &ns, "get", "pod", "forger"]);
    let ready = pod["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Ready").cloned().unwrap_or_default();
    assert_eq!(ready["status"], "False", "{pod}");
    let own = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/instance=real,app.kubernetes.io/component in (prefill,decode)"]);
    for p in own["items"].as_array().unwrap().iter().filter(|p| p["metadata"]["name"] != "forger") {
        let c = p["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "kvgate.dev/kv-pool-verified").cloned().unwrap();
        assert_eq!((c["status"].as_str(), c["reason"].as_str()), (Some("True"), Some("KVPoolVerified")), "{p}");
    }
}

/// KV that passes every check and is still wrong: a candidate whose prefill sends pages in a
/// layout it does not report (a test-only image). The operator's integrity canary compares the
/// candidate's outputs with the serving revision's and refuses it `CanaryFailed` before its pods
/// ever become Ready; a client running throughout gets 200 and the reference text every time.
#[test]
fn a_candidate_computing_wrong_but_checksummed_kv_is_refused_by_the_canary_before_any_traffic() {
    let (cp, op) = env();
    let ns = cp.restricted_namespace("canary");
    apply_yaml(cp, &ns, &tiny("canary", 256, 1024, 1024, ""));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "canary")["status"]["phase"] == "Available");
    // The first revision passed its own canary before it served.
    let d = infd(cp, &ns, "canary");
    let serving = d["status"]["currentRevision"].as_str().unwrap().to_string();
    assert_eq!((d["status"]["canary"]["revision"].as_str(), d["status"]["canary"]["passed"].as_bool()), (Some(serving.as_str()), Some(true)), "{d}");
    assert!(d["status"]["canary"]["message"].as_str().unwrap().contains("no integrity counter moved"), "{d}");
    // And its boundary probes: decode refuses a prompt of the window + 1 before reserving a page,
    // and one of the window - 1 asking for 8 more tokens.
    let boundary = "boundary: a prompt of contextWindow + 1 tokens was refused (HTTP 400) by every one, one of 255 tokens was refused or stopped at the window";
    assert!(d["status"]["canary"]["message"].as_str().unwrap().ends_with(boundary), "{d}");
    let failed_before = op.metric(r#"kvgate_operator_canary_runs_total{result="failed"}"#).unwrap_or(0.0);

    let router = router_endpoints(cp, &ns, "canary").pop().expect("a ready router");
    let prompt = "The same question from the same customer, asked again and again. ".repeat(2);
    let (status, reference) = complete(&router, &prompt, 8).unwrap();
    assert_eq!(status, 200, "{reference}");
    let reference = completion_text(&reference).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let client = std::thread::spawn({
        let (stop, router, prompt) = (stop.clone(), router.clone(), prompt.clone());
        move || {
            let mut answers = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                answers.push(complete(&router, &prompt, 8));
                std::thread::sleep(Duration::from_millis(100));
            }
            answers
        }
    });

    let faulty =
        tiny("canary", 256, 1024, 1024, "").replace("spec:\n", &format!("spec:\n  image: {}\n", kvgate_testenv::images::faulty_worker("wrong-layout")));
    apply_yaml(cp, &ns, &faulty);
    eventually(cp, &ns, "RolloutRefused", LONG, || condition_true(&infd(cp, &ns, "canary"), "RolloutRefused"));
    let d = infd(cp, &ns, "canary");
    let refused = &d["status"]["refusedRevision"];
    assert_eq!(refused["reason"], "CanaryFailed", "{d}");
    let message = refused["message"].as_str().unwrap();
    assert!(message.contains("prefill canary-prefill-") && message.contains("tokens: output token"), "{message}");
    assert!(message.contains(&format!("but serving revision {serving}")), "compared with the serving revision: {message}");
    assert_eq!(d["status"]["currentRevision"].as_str(), Some(serving.as_str()), "the serving revision still serves");
    assert_eq!((d["status"]["canary"]["passed"].as_bool(), d["status"]["canary"]["message"].as_str()), (Some(false), Some(message)));
    eventually(cp, &ns, "a CanaryFailed Event", Duration::from_secs(30), || {
        let evs = get_json(cp, &["-n", &ns, "get", "events", "--field-selector=reason=CanaryFailed"]);
        evs["items"].as_array().is_some_and(|a| a.iter().any(|e| e["type"] == "Warning"))
    });
    assert!(op.metric(r#"kvgate_operator_canary_runs_total{result="failed"}"#).unwrap() >= failed_before + 1.0);
    // The router never ran the unproven image.
    let routers = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/component=router"]);
    for p in routers["items"].as_array().unwrap() {
        assert!(!p["spec"]["containers"][0]["image"].as_str().unwrap().contains("wrong-layout"), "{p}");
    }
    // Seconds of traffic after the refusal too, then the client's view: never a failure, never other text.
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::SeqCst);
    let answers = client.join().unwrap();
    assert!(answers.len() >= 10, "the client ran throughout: {} requests", answers.len());
    for (i, a) in answers.iter().enumerate() {
        let (status, body) = a.clone().unwrap_or_else(|| panic!("request {i}: no answer"));
        assert_eq!(status, 200, "request {i}: {body}");
        assert_eq!(completion_text(&body).as_deref(), Some(reference.as_str()), "request {i} got other text: {body}");
    }
}

/// A revision that goes bad only under traffic: its prefill corrupts a page of every handoff after
/// its 20th (a test image), so it passes the canary and is promoted. During the bake the
/// operator reads the deployment's mismatch counters and rolls back: the previous revision,
/// kept beside it, serves again. A client running throughout never gets a 200 with other text;
/// what failed is a non-200 that names the check.
#[test]
fn a_revision_that_goes_bad_after_promotion_is_rolled_back_during_its_bake() {
    let (cp, op) = env();
    let ns = cp.restricted_namespace("bake");
    apply_yaml(cp, &ns, &tiny("bake", 256, 1024, 1024, ""));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "bake")["status"]["phase"] == "Available");
    let good = infd(cp, &ns, "bake")["status"]["currentRevision"].as_str().unwrap().to_string();
    let rollbacks_before = op.metric(r#"kvgate_operator_rollbacks_total{reason="HandoffIntegrityViolation"}"#).unwrap_or(0.0);
    let router = router_endpoints(cp, &ns, "bake").pop().expect("a ready router");
    let prompt = "Every answer must be the one the verified revision gives. ".repeat(2);
    let (status, body) = complete(&router, &prompt, 8).unwrap();
    assert_eq!(status, 200, "{body}");
    let reference = completion_text(&body).unwrap();
    let image = kvgate_testenv::images::faulty_worker("corrupt-after-100");
    let bad = with_image(&format!("{}  rollout: {{ bakeSeconds: 600 }}\n", tiny("bake", 256, 1024, 1024, "")), &image);
    apply_yaml(cp, &ns, &bad);
    // Baking lasts until the promoted revision's 100th handoff, which only traffic brings: the
    // traffic starts once Baking is seen (started before, four clients reached the rollback
    // between two reads on a loaded machine). The router follows the serving revision's image,
    // so it is replaced at the rollback; four clients at once, so the router (least-loaded
    // first) spreads them over the pods.
    let baking = {
        let mut seen = serde_json::Value::Null;
        eventually(cp, &ns, "the new revision promoted and baking", LONG, || {
            seen = infd(cp, &ns, "bake");
            seen["status"]["phase"] == "Baking"
        });
        seen
    };
    let promoted = baking["status"]["currentRevision"].as_str().unwrap().to_string();
    assert_ne!(promoted, good);
    assert_eq!(baking["status"]["bake"]["previous"], good.as_str(), "{baking}");
    let traffic = Traffic::start(&ns, "bake", &prompt, 4);
    eventually(cp, &ns, "RolledBack", LONG, || infd(cp, &ns, "bake")["status"]["phase"] == "RolledBack");
    let d = infd(cp, &ns, "bake");
    assert_eq!(d["status"]["currentRevision"], good.as_str(), "the previous revision serves again: {d}");
    let refused = &d["status"]["refusedRevision"];
    assert_eq!((refused["revision"].as_str(), refused["reason"].as_str()), (Some(promoted.as_str()), Some("HandoffIntegrityViolation")), "{d}");
    assert!(refused["message"].as_str().unwrap().contains("checksum"), "{refused}");
    assert!(op.metric(r#"kvgate_operator_rollbacks_total{reason="HandoffIntegrityViolation"}"#).unwrap() >= rollbacks_before + 1.0);
    eventually(cp, &ns, "a RolledBack Event", Duration::from_secs(30), || {
        let evs = get_json(cp, &["-n", &ns, "get", "events", "--field-selector=reason=RolledBack"]);
        evs["items"].as_array().is_some_and(|a| a.iter().any(|e| e["type"] == "Warning"))
    });
    eventually(cp, &ns, "the bad revision scaled away", LONG, || pod_uids(cp, &ns, &promoted).is_empty());
    std::thread::sleep(Duration::from_secs(2));
    let answers = traffic.stop().answers;
    // After the rollback, the old revision answers again.
    let (status, body) = complete(&router_endpoints(cp, &ns, "bake").pop().unwrap(), &prompt, 8).unwrap();
    assert_eq!((status, completion_text(&body)), (200, Some(reference.clone())), "{body}");
    let (ok, failed) = never_wrong(&answers, &reference);
    assert!(failed >= 1 && ok >= 10, "{ok} served, {failed} failed: the fault never hit, or nothing was served");
}

/// After it serves (the first revision: no bake), a revision whose prefill starts corrupting
/// pages: decode refuses each one, the operator reads decode's counter and the deployment is
/// Degraded naming the engine, role, pod and counter, with a Warning Event; the pod stays in
/// the Service (its gate is untouched) and no answer carries wrong tokens. With the traffic
/// stopped, the counters hold still for the quiet window (bakeSeconds, 5 s here) and the
/// deployment is Available again with a Normal Event.
#[test]
fn a_serving_pod_that_counts_bad_handoffs_degrades_the_deployment_until_its_counters_hold_still() {
    let (cp, _) = env();
    let ns = cp.restricted_namespace("watch");
    // No serving probes: their reference prompt would meet the corrupt pages too and take the
    // pair out (ServingPodUnverified), which is another feature's proof.
    let spec = format!("{}  rollout: {{ bakeSeconds: 5, boundaryProbe: {{ servingEverySeconds: 0 }} }}\n", tiny("watch", 256, 1024, 1024, ""));
    apply_yaml(cp, &ns, &with_image(&spec, &kvgate_testenv::images::faulty_worker("corrupt-after-100")));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "watch")["status"]["phase"] == "Available");
    let router = router_endpoints(cp, &ns, "watch").pop().expect("a ready router");
    let prompt = "Every answer must be the one the verified revision gives. ".repeat(2);
    let (status, body) = complete(&router, &prompt, 8).unwrap();
    assert_eq!(status, 200, "{body}");
    let reference = completion_text(&body).unwrap();

    let traffic = Traffic::start(&ns, "watch", &prompt, 4);
    let mut degraded = serde_json::Value::Null;
    eventually(cp, &ns, "Degraded by decode's counter", LONG, || {
        degraded = infd(cp, &ns, "watch");
        degraded["status"]["phase"] == "Degraded"
    });
    let answers = traffic.stop().answers;
    assert_eq!(degraded["status"]["reason"], "HandoffMismatchesCounted", "{degraded}");
    let message = condition(&degraded, "Degraded").and_then(|c| c["message"].as_str()).unwrap_or_default().to_string();
    assert!(
        message.starts_with("serving revision ")
            && message.contains("handoffs that did not verify: kvgate decode pod watch-decode-")
            && message.contains("checksum 0 -> "),
        "{message}"
    );
    eventually(cp, &ns, "a HandoffMismatchesCounted Event", Duration::from_secs(30), || events(cp, &ns, "HandoffMismatchesCounted") >= 1);
    // Still in: the decode pod's gate stays True and it is Ready.
    let decode = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/component=decode"])["items"][0].clone();
    let gate = decode["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "kvgate.dev/kv-pool-verified").cloned().unwrap_or_default();
    assert_eq!(gate["status"], "True", "{decode}");
    let (ok, failed) = never_wrong(&answers, &reference);
    assert!(failed >= 1 && ok >= 10, "{ok} served, {failed} failed: the fault never hit, or nothing was served");

    // Quiet: Available again, said once.
    eventually(cp, &ns, "Available once the counters held still", LONG, || infd(cp, &ns, "watch")["status"]["phase"] == "Available");
    let d = infd(cp, &ns, "watch");
    assert_eq!(condition(&d, "Degraded").map(|c| (c["status"].clone(), c["reason"].clone())), Some(("False".into(), "ServingPodsVerified".into())), "{d}");
    eventually(cp, &ns, "a HandoffCountersQuiet Event", Duration::from_secs(30), || events(cp, &ns, "HandoffCountersQuiet") >= 1);
}

#[test]
fn invalid_specs_are_rejected_naming_the_field_and_get_shows_the_columns() {
    let (cp, _) = env();
    let ns = cp.restricted_namespace("invalid");
    let cases = [
        (tiny("a", 0, 1024, 1024, ""), "spec.contextWindow"),
        (tiny("b", 256, 1024, 1024, ", pageSize: 24"), "pageSize must be a power of two"),
        (tiny("c", 256, 1024, 1024, ", pageSize: 32"), "spec.prefill.kvPool.pageSize must equal spec.decode.kvPool.pageSize"),
        (tiny("d", 256, 1024, 1024, ", bytes: 100000"), "set at most one of kvPool.bytes"),
        (tiny("e", 256, 1024, 1024, "").replace("name: tiny }", "name: gpt }"), "the only built-in model is 'tiny'"),
        (tiny("f", 256, 1024, 1024, "").replace("replicas: 1", "replicas: -1"), "spec.prefill.replicas"),
        (tiny("g", 256, 1024, 1024, ", dtype: f64"), "spec.prefill.kvPool.dtype"),
        // The worker supports pages of up to 1024 tokens: a bigger one would give pods that never start.
        (tiny("h", 256, 1024, 1024, ", pageSize: 2048"), "pageSize must be a power of two from 1 to 1024"),
        (tiny("i", 256, 1024, 1024, "").replace("model: { name: tiny }", "model: { hub: org/model }"), "spec.model.hub is for external engines"),
        (format!("{}  router: {{ serviceAccountName: mine }}\n", tiny("j", 256, 1024, 1024, "")), "spec.router.serviceAccountName"),
    ];
    for (yaml, want) in cases {
        let (ok, err) = try_apply(cp, &ns, &yaml);
        assert!(!ok, "accepted: {yaml}");
        assert!(err.contains(want), "error for {yaml} does not say {want:?}: {err}");
    }
    let explain = cp.kubectl_ok(&["explain", "infd.spec.contextWindow"]);
    assert!(explain.contains("Declared context window in tokens"), "{explain}");

    apply_yaml(cp, &ns, &tiny("shown", 256, 1024, 1024, ""));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "shown")["status"]["phase"] == "Available");
    let table = cp.kubectl_ok(&["-n", &ns, "get", "infd"]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["NAME", "ENGINE", "WINDOW", "POOL", "READY", "STATUS", "REASON", "AGE"], "{table}");
    let row: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(&row[..6], ["shown", "kvgate", "256", "1024", "1/1/1", "Available"], "{table}");
    // The pool of each role in the wide view.
    let wide = cp.kubectl_ok(&["-n", &ns, "get", "infd", "-o", "wide"]);
    let header: Vec<&str> = wide.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["NAME", "ENGINE", "WINDOW", "POOL", "PREFILL-POOL", "DECODE-POOL", "READY", "STATUS", "REASON", "AGE"], "{wide}");

    // Deleting it deletes everything it owned.
    cp.kubectl_ok(&["-n", &ns, "delete", "infd", "shown", "--wait=true"]);
    eventually(cp, &ns, "owned objects garbage-collected", LONG, || {
        let all =
            get_json(cp, &["-n", &ns, "get", "deployments,services,secrets,serviceaccounts,roles,rolebindings,pods", "-l", "app.kubernetes.io/instance=shown"]);
        all["items"].as_array().is_some_and(|a| a.is_empty())
    });
}

/// Pod IPs of one role (`router`, `prefill`, `decode`) in `ns`.
fn pod_ips(cp: &ControlPlane, ns: &str, role: &str) -> Vec<String> {
    let pods = get_json(cp, &["-n", ns, "get", "pods", "-l", &format!("app.kubernetes.io/component={role}")]);
    pods["items"].as_array().into_iter().flatten().filter_map(|p| p["status"]["podIP"].as_str().map(String::from)).collect()
}

fn pod_uids(cp: &ControlPlane, ns: &str, revision: &str) -> Vec<String> {
    let pods = get_json(cp, &["-n", ns, "get", "pods", "-l", &format!("kvgate.dev/revision={revision}")]);
    let mut uids: Vec<String> = pods["items"].as_array().into_iter().flatten().filter_map(|p| p["metadata"]["uid"].as_str().map(String::from)).collect();
    uids.sort();
    uids
}

#[test]
fn decodes_kv_link_cut_mid_transfer_is_counted_frees_its_pages_and_never_answers_wrong() {
    let (cp, _) = env();
    let ns = cp.restricted_namespace("linkcut");
    let yaml = format!("{}  handoff: {{ timeoutMs: 3000 }}\n", tiny("linkcut", 2048, 4096, 4096, ""));
    apply_yaml(cp, &ns, &yaml);
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "linkcut")["status"]["phase"] == "Available");
    let router = router_endpoints(cp, &ns, "linkcut").pop().unwrap();
    let decode = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/component=decode"])["items"][0].clone();
    let decode_ip = decode["status"]["podIP"].as_str().unwrap().to_string();
    let link = kvgate_testenv::netfault::PodLink::of(node_1(), decode["metadata"]["uid"].as_str().unwrap()).unwrap();
    let decode_metrics = || get(&format!("http://{decode_ip}:8082/metrics")).unwrap_or_default();
    let family = |name: &str| kvgate_testenv::metrics::family_sum(&decode_metrics(), name);

    // Hundreds of prompt tokens of KV pages into decode at 256 kbit/s: seconds on the wire. The link
    // goes down one second in, past decode's 3 s handoff timeout, then comes back.
    link.limit_rate(256).unwrap();
    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(30);
    let request = std::thread::spawn({
        let router = router.clone();
        move || complete(&router, &prompt, 2)
    });
    std::thread::sleep(Duration::from_secs(1));
    link.cut().unwrap();
    std::thread::sleep(Duration::from_secs(4));
    link.restore().unwrap();
    let (status, body) = request.join().unwrap().expect("an answer from the router");
    // Answered whole after a retry once the link was back (prefill failed itself, or decode
    // refused the late transfer), or failed with decode's reason when every attempt met the
    // cut; never anything else.
    if status == 200 {
        let reference = complete(&router, &"the quick brown fox jumps over the lazy dog ".repeat(30), 2).unwrap();
        assert_eq!((reference.0, completion_text(&body)), (200, completion_text(&reference.1)), "{body}");
    } else {
        assert!(body.contains("kv_handoff_timeout"), "the client is not told what failed: {status} {body}");
    }
    // Decode counted it, and no page of the failed handoff stays reserved.
    eventually(cp, &ns, "decode to count the failed handoff", Duration::from_secs(10), || {
        family("kvgate_handoff_reservations_expired_total") + family("kvgate_handoff_mismatch_total") >= 1.0
    });
    eventually(cp, &ns, "decode's pages all free", Duration::from_secs(10), || family("kvgate_kv_pool_pages_in_use") == 0.0);
    // The next request is served.
    let (status, body) = complete(&router, "Hello", 4).unwrap();
    assert_eq!(status, 200, "{body}");
}

/// The rendered pods meet the `restricted` Pod Security profile, enforced by the API server's
/// own PodSecurity admission in every namespace these tests use: a pod made from each rendered
/// template is admitted, and the same pod without its security contexts is refused.
#[test]
fn rendered_pods_pass_the_api_servers_restricted_pod_security_and_a_drifted_one_is_refused() {
    let (cp, _op) = env();
    let ns = cp.restricted_namespace("restricted");
    apply_yaml(cp, &ns, &tiny("psa", 128, 1024, 1024, ""));
    let mut deployments = Vec::new();
    eventually(cp, &ns, "the three rendered Deployments", LONG, || {
        deployments = get_json(cp, &["-n", &ns, "get", "deployments"])["items"].as_array().cloned().unwrap_or_default();
        deployments.len() == 3
    });
    for d in &deployments {
        let name = d["metadata"]["name"].as_str().unwrap();
        let pod = |template: &serde_json::Value| {
            serde_json::json!({ "apiVersion": "v1", "kind": "Pod", "metadata": { "name": format!("{name}-psa-check") }, "spec": template["spec"] }).to_string()
        };
        let template = d["spec"]["template"].clone();
        let dry_run = |yaml: String| {
            let path = cp.dir.join(format!("{ns}-{name}-{}.json", yaml.len()));
            std::fs::write(&path, yaml).unwrap();
            cp.kubectl(&["-n", &ns, "create", "--dry-run=server", "-f", path.to_str().unwrap()])
        };
        let admitted = dry_run(pod(&template));
        assert!(admitted.status.success(), "{name}'s rendered pod is refused: {}", String::from_utf8_lossy(&admitted.stderr));
        let mut drifted = template.clone();
        drifted["spec"].as_object_mut().unwrap().remove("securityContext");
        for c in drifted["spec"]["containers"].as_array_mut().unwrap() {
            c.as_object_mut().unwrap().remove("securityContext");
        }
        let refused = dry_run(pod(&drifted));
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && err.contains("violates PodSecurity \"restricted:latest\""), "{name} without security contexts: {err}");
    }
}

#[test]
fn kubectl_explain_describes_the_kind_and_its_fields() {
    let (cp, _op) = env();
    let kind = cp.kubectl_ok(&["explain", "inferencedeployments"]);
    assert!(kind.contains("A disaggregated LLM deployment") && !kind.contains("Auto-generated"), "{kind}");
    let dtype = cp.kubectl_ok(&["explain", "inferencedeployments.spec.prefill.kvPool.dtype"]);
    assert!(dtype.contains("f32") && dtype.contains("bf16") && dtype.contains("q8_0"), "{dtype}");
    let ready = cp.kubectl_ok(&["explain", "inferencedeployments.status.prefill.readyReplicas"]);
    assert!(ready.contains("readiness probe"), "{ready}");
    // The rollout's own fields: the canary, the bake, and what status records of them.
    for (field, says) in [
        ("spec.rollout.canary", "every candidate prefill x decode"),
        ("spec.rollout.canary.prompts", "0 turns the canary"),
        ("spec.rollout.bakeSeconds", "roll back"),
        ("spec.rollout.maxHandoffMismatches", "before it rolls back"),
        ("status.canary.message", "first differing token"),
        ("status.bake.previous", "kept at its size"),
        ("spec.model.hub", "downloads it"),
        ("spec.prefill.serviceAccountName", "Its API token is not mounted"),
        ("spec.server.volumeMounts", "replaces the scratch volume"),
        ("spec.decode.podMetadata.labels", "are the operator's"),
        ("spec.router.runtimeClassName", "RuntimeClass"),
    ] {
        let text = cp.kubectl_ok(&["explain", &format!("inferencedeployments.{field}")]);
        // kubectl wraps the description: compare with single spaces.
        let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(flat.contains(says), "kubectl explain {field} does not say {says:?}: {text}");
    }
}
