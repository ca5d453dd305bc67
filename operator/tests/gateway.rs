//! The optional `InferencePool` a gateway's endpoint picker reads (Gateway API Inference
//! Extension), checked against that project's released CRD installed on the test control
//! plane: absent CRD, then installed, drift, removal from the spec and back, and deletion of the
//! deployment and its re-creation.

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
