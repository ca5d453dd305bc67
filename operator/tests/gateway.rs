//! The optional `InferencePool` a gateway's endpoint picker reads (Gateway API Inference
//! Extension), checked against that project's released CRD installed on the test control
//! plane: absent CRD, then installed, drift, removal from the spec and back, and deletion of the
//! deployment and its re-creation. And the API's own door: API keys from a Secret, changed
//! without a restart.

mod support;

use std::time::Duration;

use kvgate_testenv::ControlPlane;
use serde_json::Value;
use support::*;

const LONG: Duration = Duration::from_secs(120);
const CRD: &str = "crd/inferencepools.inference.networking.k8s.io";

fn with_pool(name: &str) -> String {
    format!("{}  inferencePool:\n    endpointPicker: {{ name: {name}-epp }}\n", tiny(name, 256, 1024, 1024, ""))
}

fn pool(cp: &ControlPlane, ns: &str, name: &str) -> Value {
    get_json(cp, &["-n", ns, "get", "inferencepools.inference.networking.k8s.io", name])
}

fn names(list: &Value) -> Vec<String> {
    let mut n: Vec<String> = list["items"].as_array().into_iter().flatten().filter_map(|o| o["metadata"]["name"].as_str().map(String::from)).collect();
    n.sort();
    n
}

#[test]
fn an_inference_pool_is_rendered_when_asked_and_follows_the_spec_and_the_deployment() {
    let cp = cluster();
    let ns = cp.restricted_namespace("gateway");
    let _op = Operator::start_in(cp, "operator-gateway", "lease-gateway", Some(&ns));

    // A value outside the API's enum is refused by kvgate's own schema, naming the field.
    let bad = with_pool("bad").replace("{ name: bad-epp }", "{ name: bad-epp, failureMode: Sometimes }");
    let (ok, err) = try_apply(cp, &ns, &bad);
    assert!(!ok && err.contains("spec.inferencePool.endpointPicker.failureMode") && err.contains("FailClose"), "{err}");

    // Asked for before the cluster serves InferencePools: the deployment serves anyway, and
    // says why there is no pool.
    apply_yaml(cp, &ns, &with_pool("llm"));
    eventually(cp, &ns, "Available with InferencePoolReady False (CRDNotInstalled)", LONG, || {
        let d = infd(cp, &ns, "llm");
        d["status"]["phase"] == "Available" && condition(&d, "InferencePoolReady").is_some_and(|c| c["status"] == "False" && c["reason"] == "CRDNotInstalled")
    });
    let message = condition(&infd(cp, &ns, "llm"), "InferencePoolReady").unwrap()["message"].as_str().unwrap().to_string();
    assert!(message.contains("inference.networking.k8s.io/v1 InferencePool") && message.contains("install"), "{message}");
    assert_eq!(events(cp, &ns, "CRDNotInstalled"), 1, "one Warning Event for the transition, not one per pass");

    // The Gateway API Inference Extension's CRD installed: the pool appears (next pass, <= 30 s).
    cp.kubectl_ok(&["apply", "-f", repo("tests/fixtures/inferencepool-crd.yaml").to_str().unwrap()]);
    cp.kubectl_ok(&["wait", "--for=condition=Established", CRD, "--timeout=30s"]);
    eventually(cp, &ns, "InferencePoolReady True", LONG, || condition_true(&infd(cp, &ns, "llm"), "InferencePoolReady"));
    let p = pool(cp, &ns, "llm");
    let spec = &p["spec"];
    assert_eq!(spec["endpointPickerRef"]["name"], "llm-epp");
    assert_eq!(spec["endpointPickerRef"]["port"]["number"], 9002);
    assert_eq!(spec["endpointPickerRef"]["failureMode"], "FailClose");
    // It selects exactly the routers, the pods behind the deployment's Service.
    let selector: Vec<String> = spec["selector"]["matchLabels"].as_object().unwrap().iter().map(|(k, v)| format!("{k}={}", v.as_str().unwrap())).collect();
    let selected = names(&get_json(cp, &["-n", &ns, "get", "pods", "-l", &selector.join(",")]));
    let routers = names(&get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/component=router,app.kubernetes.io/instance=llm"]));
    assert!(!routers.is_empty() && selected == routers, "pool selects {selected:?}, routers are {routers:?}");
    // On the port the routers serve their API on.
    let router = get_json(cp, &["-n", &ns, "get", "pod", &routers[0]]);
    let http = router["spec"]["containers"][0]["ports"].as_array().unwrap().iter().find(|p| p["name"] == "http").unwrap()["containerPort"].clone();
    assert_eq!(spec["targetPorts"], serde_json::json!([{ "number": http }]), "{p}");
    assert_eq!(p["metadata"]["ownerReferences"][0]["uid"], infd(cp, &ns, "llm")["metadata"]["uid"]);

    // Someone edits it: the operator puts back what the spec says.
    cp.kubectl_ok(&[
        "-n",
        &ns,
        "patch",
        "inferencepools.inference.networking.k8s.io",
        "llm",
        "--type=merge",
        "-p",
        r#"{"spec":{"targetPorts":[{"number":9999}]}}"#,
    ]);
    eventually(cp, &ns, "the edited pool restored", LONG, || pool(cp, &ns, "llm")["spec"]["targetPorts"][0]["number"] == http);

    // No longer asked for: deleted, condition gone; asked again: created again.
    apply_yaml(cp, &ns, &tiny("llm", 256, 1024, 1024, ""));
    eventually(cp, &ns, "the pool deleted and its condition gone", LONG, || {
        pool(cp, &ns, "llm").is_null() && condition(&infd(cp, &ns, "llm"), "InferencePoolReady").is_none()
    });
    apply_yaml(cp, &ns, &with_pool("llm"));
    eventually(cp, &ns, "the pool created again", LONG, || pool(cp, &ns, "llm")["spec"]["endpointPickerRef"]["name"] == "llm-epp");
    assert_eq!(infd(cp, &ns, "llm")["status"]["phase"], "Available", "the pool is not a rollout");

    // The deployment deleted: its pool is collected with it. Re-created: a pool of its own.
    let first_uid = infd(cp, &ns, "llm")["metadata"]["uid"].as_str().unwrap().to_string();
    cp.kubectl_ok(&["-n", &ns, "delete", "infd", "llm", "--wait=true", "--timeout=60s"]);
    eventually(cp, &ns, "the pool collected with its deployment", LONG, || pool(cp, &ns, "llm").is_null());
    apply_yaml(cp, &ns, &with_pool("llm"));
    eventually(cp, &ns, "the namesake's pool", LONG, || {
        let owner = &pool(cp, &ns, "llm")["metadata"]["ownerReferences"][0]["uid"];
        owner.is_string() && owner != first_uid.as_str() && *owner == infd(cp, &ns, "llm")["metadata"]["uid"]
    });
    eventually(cp, &ns, "the namesake Available with its pool", LONG, || {
        let d = infd(cp, &ns, "llm");
        d["status"]["phase"] == "Available" && condition_true(&d, "InferencePoolReady")
    });
}

/// A completion through `router` with `key` (none: no Authorization header): the status.
fn ask(router: &str, key: Option<&str>) -> Option<u16> {
    let body = serde_json::json!({ "prompt": "Hello", "max_tokens": 2, "temperature": 0 }).to_string();
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    request_with("POST", &format!("http://{router}/v1/completions"), &headers, Some(&body)).map(|(status, _)| status)
}

#[test]
fn api_keys_from_a_secret_authenticate_the_api_and_change_without_a_restart() {
    let cp = cluster();
    let ns = cp.restricted_namespace("tenants");
    let _op = Operator::start_in(cp, "operator-tenants", "lease-tenants", Some(&ns));
    let auth = |block: &str| format!("{}  auth:\n{block}", tiny("llm", 256, 1024, 1024, ""));

    // Refused by the schema, naming the field: neither way to authenticate, a range that is no
    // CIDR, a tenant named twice.
    for (block, want) in [
        ("    tokensPerMinute: 10\n", "spec.auth.apiKeysSecret"),
        ("    trustedProxy: { header: x-tenant, sourceRanges: [10.0.0.300/8] }\n", "spec.auth.trustedProxy.sourceRanges"),
        ("    apiKeysSecret: k\n    tenants: [{ name: a, tokensPerMinute: 1 }, { name: a, tokensPerMinute: 2 }]\n", "spec.auth.tenants"),
    ] {
        let (ok, err) = try_apply(cp, &ns, &auth(block));
        assert!(!ok && err.contains(want), "{block}: {err}");
    }

    const OLD: &str = "sk-acme-0123456789abcdef";
    const NEW: &str = "sk-acme-rotated-fedcba9876";
    const GLOBEX: &str = "sk-globex-0123456789abcd";
    let secret = |acme: &str, globex: Option<&str>| {
        let extra = globex.map(|g| format!("  globex: {g}\n")).unwrap_or_default();
        format!("apiVersion: v1\nkind: Secret\nmetadata: {{ name: api-keys }}\nstringData:\n  acme: {acme}\n{extra}")
    };
    apply_yaml(cp, &ns, &secret(OLD, None));
    apply_yaml(cp, &ns, &auth("    apiKeysSecret: api-keys\n    tenants: [{ name: acme, tokensPerMinute: 100000 }]\n"));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "llm")["status"]["phase"] == "Available");
    let router = router_endpoints(cp, &ns, "llm").pop().expect("a ready router");
    assert_eq!(ask(&router, Some(OLD)), Some(200));
    assert_eq!(ask(&router, None), Some(401));
    assert_eq!(ask(&router, Some(GLOBEX)), Some(401));
    let pods = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/component=router"]);
    let before: Vec<String> = pods["items"].as_array().unwrap().iter().map(|p| p["metadata"]["name"].as_str().unwrap().to_string()).collect();
    let args = pods["items"][0]["spec"]["containers"][0]["args"].to_string();
    assert!(args.contains("--api-keys=/etc/kvgate/api-keys") && args.contains("--tenant-quota=acme=100000"), "{args}");

    // Rotated and a tenant added in the Secret: the router reads it again, no restart.
    apply_yaml(cp, &ns, &secret(NEW, Some(GLOBEX)));
    eventually(cp, &ns, "the rotated keys in force", Duration::from_secs(30), || {
        ask(&router, Some(OLD)) == Some(401) && ask(&router, Some(NEW)) == Some(200) && ask(&router, Some(GLOBEX)) == Some(200)
    });
    let pods = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/component=router"]);
    let after: Vec<String> = pods["items"].as_array().unwrap().iter().map(|p| p["metadata"]["name"].as_str().unwrap().to_string()).collect();
    assert_eq!(after, before, "the router pods were not replaced");
    assert_eq!(pods["items"][0]["status"]["containerStatuses"][0]["restartCount"], 0);
    // The keys are the Secret's alone: never in the deployment's status or the operator's Events.
    let everything = format!("{}{}", infd(cp, &ns, "llm"), get_json(cp, &["-n", &ns, "get", "events"]));
    assert!(!everything.contains("sk-acme") && !everything.contains("sk-globex"), "a key leaked into status or Events");

    // The Secret deleted and created again: the keys stay in force meanwhile (as the kubelet
    // leaves a mounted Secret's files), and the new one is read.
    cp.kubectl_ok(&["-n", &ns, "delete", "secret", "api-keys"]);
    assert_eq!(ask(&router, Some(NEW)), Some(200));
    apply_yaml(cp, &ns, &secret(OLD, None));
    eventually(cp, &ns, "the re-created Secret's keys in force", Duration::from_secs(30), || {
        ask(&router, Some(OLD)) == Some(200) && ask(&router, Some(GLOBEX)) == Some(401)
    });
}
