//! The gate in front of an engine users already run: llama.cpp's real server (the test image
//! `ghcr.io/kvgate/llamacpp`, llama-server's flags over the xllamacpp wheel) serving a random
//! Llama written as a GGUF with the `gguf` package, under runc like every pod here.
//!
//! `-c 4096 -np 4` splits the KV cache into four slots of 1,024 tokens: a deployment that
//! declares 4,096 is the incident's misconfiguration in miniature, refused with llama.cpp's own
//! numbers. With a unified cache every slot may use 4,096: Available, answering through the
//! Service. A pod of the serving revision that comes up with a smaller cache is out of the
//! Service at once and the deployment Degraded.

mod support;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use kvgate_testenv::ControlPlane;
use support::*;

const LONG: Duration = Duration::from_secs(180);

/// The directory holding the tiny GGUF (a hostPath the operator allows), made once.
fn models(cp: &ControlPlane) -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = cp.dir.join("models");
        kvgate_testenv::models::write(kvgate_testenv::models::Format::Gguf, &dir.join("tiny.gguf"));
        dir
    })
}

/// One operator for this binary, allowed to mount the models directory.
fn env() -> (&'static ControlPlane, &'static Operator) {
    static OP: OnceLock<Operator> = OnceLock::new();
    let cp = cluster();
    let dir = models(cp).display().to_string();
    (cp, OP.get_or_init(|| Operator::start_with(cp, "operator-engines", "lease-engines", None, &[&format!("--allowed-host-paths={dir}")])))
}

/// A llama.cpp deployment declaring `window`, its server started with `args`.
fn llamacpp(cp: &ControlPlane, name: &str, window: u64, args: &[&str]) -> String {
    let args: Vec<String> = ["-m", "/models/tiny.gguf", "--port", "8080"].iter().chain(args).map(|a| format!("\"{a}\"")).collect();
    format!(
        "apiVersion: kvgate.dev/v1alpha1\nkind: InferenceDeployment\nmetadata: {{ name: {name} }}\nspec:\n  engine: llamacpp\n  contextWindow: {window}\n  model: {{ path: tiny.gguf, volume: {{ hostPath: {dir} }} }}\n  server:\n    replicas: 1\n    container:\n      name: llama-server\n      image: {image}\n      args: [{args}]\n  rollout: {{ bakeSeconds: 0 }}\n",
        dir = models(cp).display(),
        image = kvgate_testenv::images::llamacpp(),
        args = args.join(", "),
    )
}

#[test]
fn four_slots_of_a_4096_token_cache_are_refused_for_a_4096_token_window_with_llamacpps_numbers() {
    let (cp, op) = env();
    let ns = models_namespace(cp, "llamacpp-slots");
    apply_yaml(cp, &ns, &llamacpp(cp, "slots", 4096, &["-c", "4096", "-np", "4"]));
    eventually(cp, &ns, "RolloutRefused", LONG, || condition_true(&infd(cp, &ns, "slots"), "RolloutRefused"));
    let d = infd(cp, &ns, "slots");
    let refused = &d["status"]["refusedRevision"];
    assert_eq!(refused["reason"], "KVPoolBelowContextWindow", "{d}");
    let message = refused["message"].as_str().unwrap();
    assert!(message.starts_with("llamacpp pod slots-server-") && message.ends_with(": n_ctx per slot 1024 < contextWindow 4096"), "{message}");
    assert_eq!(d["status"]["phase"], "Refused");
    assert_eq!(d["status"]["server"]["minMeasuredTokens"], 1024, "{d}");
    assert_eq!(condition(&d, "Available").unwrap()["status"], "False");
    assert!(op.metric(r#"kvgate_operator_rollouts_refused_total{reason="KVPoolBelowContextWindow"}"#).unwrap_or(0.0) >= 1.0);
    eventually(cp, &ns, "a RolloutRefused Event with llama.cpp's numbers", Duration::from_secs(30), || {
        let evs = get_json(cp, &["-n", &ns, "get", "events", "--field-selector=reason=RolloutRefused"]);
        evs["items"].as_array().is_some_and(|a| a.iter().any(|e| e["message"].as_str().unwrap_or("").contains("n_ctx per slot 1024 < contextWindow 4096")))
    });
    // Scaled away; nothing ever served: no endpoint was ever ready.
    eventually(cp, &ns, "the refused pods gone", LONG, || {
        get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/component=server"])["items"].as_array().is_some_and(|a| a.is_empty())
    });
    assert!(router_endpoints(cp, &ns, "slots").is_empty());
}

#[test]
fn a_unified_cache_holds_the_window_passes_the_canary_and_serves_and_a_smaller_serving_pod_is_degraded() {
    let (cp, op) = env();
    let ns = models_namespace(cp, "llamacpp-unified");
    apply_yaml(cp, &ns, &llamacpp(cp, "unified", 4096, &["-c", "4096", "-np", "4", "--kv-unified"]));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "unified")["status"]["phase"] == "Available");
    let d = infd(cp, &ns, "unified");
    assert_eq!((d["status"]["minMeasuredTokens"].as_u64(), d["status"]["ready"].as_str()), (Some(4096), Some("1")), "{d}");
    let canary = &d["status"]["canary"];
    assert_eq!(canary["passed"], true, "{d}");
    assert!(canary["message"].as_str().unwrap().contains("through 1 llamacpp pods"), "{canary}");
    // The boundary probes ran: llama.cpp refuses a prompt of the window + 1 and stops at the window.
    assert!(
        canary["message"].as_str().unwrap().contains(
            "boundary: a prompt of contextWindow + 1 tokens was refused (HTTP 400) by every one, one of 4095 tokens was refused or stopped at the window"
        ),
        "{canary}"
    );
    let gate = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/component=server"])["items"][0]["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "kvgate.dev/kv-pool-verified")
        .cloned()
        .unwrap();
    assert_eq!(gate["message"].as_str().unwrap().split(": ").nth(1), Some("n_ctx per slot 4096 >= contextWindow 4096"), "{gate}");
    // Requests go to the engine through the deployment's Service: llama.cpp answers them.
    let server = router_endpoints(cp, &ns, "unified").pop().expect("a ready server endpoint");
    let (status, body) = complete(&server, "Hello", 4).unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"text_completion\""), "{body}");

    // A pod of the serving revision that came up with a smaller cache (labels of the revision,
    // -c 1024): verified again like every serving pod, it fails, leaves the Service and the
    // deployment is Degraded; the serving revision keeps serving on its good pod.
    let real = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/component=server"])["items"][0].clone();
    let mut labels = real["metadata"]["labels"].clone();
    labels.as_object_mut().unwrap().remove("pod-template-hash");
    let mut small = serde_json::json!({ "apiVersion": "v1", "kind": "Pod", "metadata": { "name": "smaller", "labels": labels }, "spec": real["spec"] });
    small["spec"]["containers"][0]["args"] = serde_json::json!(["-m", "/models/tiny.gguf", "--port", "8080", "-c", "1024", "-np", "1"]);
    small["spec"].as_object_mut().unwrap().remove("nodeName");
    apply_yaml(cp, &ns, &small.to_string());
    eventually(cp, &ns, "Degraded naming the smaller pod", LONG, || {
        condition(&infd(cp, &ns, "unified"), "Degraded").is_some_and(|c| {
            c["status"] == "True" && c["message"].as_str().unwrap_or("").contains("llamacpp pod smaller: n_ctx per slot 1024 < contextWindow 4096")
        })
    });
    let d = infd(cp, &ns, "unified");
    // Still serving on its good pod; the phase says a pod is out, and the plugin says which.
    assert_eq!((d["status"]["phase"].as_str(), d["status"]["reason"].as_str()), (Some("Degraded"), Some("ServingPodUnverified")), "{d}");
    let wants = [
        "unified (llamacpp engine, contextWindow 4096): Degraded (ServingPodUnverified)",
        "n_ctx per slot 1024 < contextWindow 4096",
        "to change: the pod named above",
    ];
    why_says(cp, &ns, "unified", 1, &wants);
    assert_eq!(
        op.metric(&format!(r#"kvgate_operator_serving_pods_unverified{{name="unified",namespace="{ns}"}}"#)),
        Some(1.0),
        "the series KvgateServingPodUnverified fires on"
    );
    let ips: Vec<String> = router_endpoints(cp, &ns, "unified");
    let smaller_ip = get_json(cp, &["-n", &ns, "get", "pod", "smaller"])["status"]["podIP"].as_str().map(String::from);
    assert!(smaller_ip.is_some_and(|ip| !ips.contains(&format!("{ip}:8080"))), "the smaller pod is not in the Service: {ips:?}");
    // The smaller pod goes: Degraded clears.
    cp.kubectl_ok(&["-n", &ns, "delete", "pod", "smaller", "--wait=false"]);
    eventually(cp, &ns, "Degraded cleared", LONG, || !condition_true(&infd(cp, &ns, "unified"), "Degraded"));
}

/// What a platform needs on an engine's pods: a model by hub name with its token from a Secret
/// (no model volume), a ServiceAccount, a PriorityClass, a RuntimeClass, pull secrets, labels
/// and annotations, and volumes of its own. Here llama.cpp cannot download (no network), so its
/// weights come from one of those volumes; the hub name and token reach it as env. A role's
/// hostPath volume is held to the operator's allowlist like the model's.
#[test]
fn an_engine_loads_a_hub_model_with_a_token_and_the_pod_fields_platforms_need() {
    let (cp, _) = env();
    let ns = models_namespace(cp, "platform");
    let objects = format!(
        "apiVersion: v1\nkind: ServiceAccount\nmetadata: {{ name: model-reader }}\n---\napiVersion: v1\nkind: Secret\nmetadata: {{ name: hub }}\nstringData: {{ token: hf_not_a_real_token }}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{ name: extra }}\ndata: {{ note.txt: mounted by the platform }}\n---\napiVersion: scheduling.k8s.io/v1\nkind: PriorityClass\nmetadata: {{ name: {ns}-serving }}\nvalue: 1000\n---\napiVersion: node.k8s.io/v1\nkind: RuntimeClass\nmetadata: {{ name: {ns}-runc }}\nhandler: runc\n"
    );
    apply_yaml(cp, &ns, &objects);
    let platform = format!(
        "    serviceAccountName: model-reader\n    priorityClassName: {ns}-serving\n    runtimeClassName: {ns}-runc\n    imagePullSecrets: [{{ name: registry }}]\n    podMetadata: {{ labels: {{ team: search }}, annotations: {{ mesh.example/inject: \"false\" }} }}\n    volumes: [{{ name: weights, hostPath: {{ path: {dir} }} }}, {{ name: extra, configMap: {{ name: extra }} }}]\n    volumeMounts: [{{ name: weights, mountPath: /weights, readOnly: true }}, {{ name: extra, mountPath: /etc/extra }}]\n",
        dir = models(cp).display()
    );
    let yaml = llamacpp(cp, "hub", 4096, &["-c", "4096", "-np", "1"])
        .replace("model: { path: tiny.gguf, volume: { hostPath: ", "model: { hub: ggml-org/tiny, tokenSecret: { name: hub, key: token } }\n  #")
        .replace("\"/models/tiny.gguf\"", "\"/weights/tiny.gguf\"")
        .replace("    container:\n", &format!("{platform}    container:\n"));
    apply_yaml(cp, &ns, &yaml);
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "hub")["status"]["phase"] == "Available");
    let pod = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/component=server"])["items"][0].clone();
    let spec = &pod["spec"];
    assert_eq!(
        (&spec["serviceAccountName"], &spec["priorityClassName"], &spec["runtimeClassName"], &spec["imagePullSecrets"][0]["name"]),
        (
            &serde_json::json!("model-reader"),
            &serde_json::json!(format!("{ns}-serving")),
            &serde_json::json!(format!("{ns}-runc")),
            &serde_json::json!("registry")
        ),
        "{spec}"
    );
    assert_eq!(spec["priority"], 1000, "the API server resolved the PriorityClass: {spec}");
    assert_eq!(pod["metadata"]["labels"]["team"], "search");
    assert_eq!(pod["metadata"]["labels"]["app.kubernetes.io/component"], "server", "the operator's labels stay");
    assert_eq!(pod["metadata"]["annotations"]["mesh.example/inject"], "false");
    let volumes: Vec<&str> = spec["volumes"].as_array().unwrap().iter().filter_map(|v| v["name"].as_str()).collect();
    assert!(volumes.contains(&"weights") && volumes.contains(&"extra") && !volumes.contains(&"model"), "no model volume for a hub model: {volumes:?}");
    let c = &spec["containers"][0];
    let env = |name: &str| c["env"].as_array().unwrap().iter().find(|e| e["name"] == name).cloned().unwrap_or_default();
    assert_eq!(env("KVGATE_MODEL")["value"], "ggml-org/tiny");
    assert_eq!(env("HF_TOKEN")["valueFrom"]["secretKeyRef"], serde_json::json!({ "name": "hub", "key": "token" }));
    assert!(!pod.to_string().contains("hf_not_a_real_token"), "the token is in the pod spec: {pod}");
    // It serves, from the platform's volume.
    let server = router_endpoints(cp, &ns, "hub").pop().expect("a ready server endpoint");
    assert_eq!(complete(&server, "Hello", 4).map(|r| r.0), Some(200));

    // The same volume outside the allowlist: refused before any pod, naming the role's field.
    let outside =
        yaml.replace("metadata: { name: hub }", "metadata: { name: hub-outside }").replace(&format!("path: {} }}", models(cp).display()), "path: /etc }");
    apply_yaml(cp, &ns, &outside);
    eventually(cp, &ns, "RolloutRefused", LONG, || condition_true(&infd(cp, &ns, "hub-outside"), "RolloutRefused"));
    let refused = infd(cp, &ns, "hub-outside")["status"]["refusedRevision"].clone();
    assert_eq!(refused["reason"], "HostPathNotAllowed", "{refused}");
    assert!(refused["message"].as_str().unwrap().starts_with(r#"spec.server.volumes[weights].hostPath "/etc" may not be mounted"#), "{refused}");
}

/// examples/vllm-pd.yaml as a user applies it: the operator renders kvgate's connector around
/// the NixlConnector each role names (the package from a ConfigMap it owns, the deployment's
/// handoff Secret, the flag rewritten) without the user changing the image; a ConfigMap deleted
/// by hand is applied again by the running operator. (The pods need GPUs and a model claim: here
/// they never start; `make test-vllm` runs a real pair.)
#[test]
fn a_disaggregated_vllm_gets_kvgates_connector_and_its_configmap_back_when_deleted() {
    let (cp, _) = env();
    let ns = cp.namespace("connector");
    apply_yaml(cp, &ns, &std::fs::read_to_string(repo("examples/vllm-pd.yaml")).unwrap());
    let config_maps = || {
        let all = get_json(cp, &["-n", &ns, "get", "configmaps", "-l", "app.kubernetes.io/instance=vllm-pd"]);
        all["items"].as_array().cloned().unwrap_or_default()
    };
    eventually(cp, &ns, "the connector's ConfigMap", LONG, || config_maps().len() == 1);
    let cm = config_maps().remove(0);
    let name = cm["metadata"]["name"].as_str().unwrap().to_string();
    assert!(name.starts_with("vllm-pd-vllm-connector-"), "{name}");
    assert_eq!((cm["immutable"].as_bool(), cm["metadata"]["ownerReferences"][0]["kind"].as_str()), (Some(true), Some("InferenceDeployment")), "{cm}");
    assert!(cm["data"]["connector.py"].as_str().is_some_and(|t| t.contains("class KvgateConnector")), "the package's files: {cm}");
    let uid = cm["metadata"]["uid"].clone();
    eventually(cp, &ns, "status.handoffSecret", LONG, || infd(cp, &ns, "vllm-pd")["status"]["handoffSecret"].is_string());
    let secret = infd(cp, &ns, "vllm-pd")["status"]["handoffSecret"].as_str().unwrap().to_string();

    for role in ["prefill", "decode"] {
        let deps = get_json(cp, &["-n", &ns, "get", "deployments", "-l", &format!("app.kubernetes.io/instance=vllm-pd,app.kubernetes.io/component={role}")]);
        let pod = &deps["items"][0]["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        let args: Vec<&str> = c["args"].as_array().unwrap().iter().filter_map(|a| a.as_str()).collect();
        let at = args.iter().position(|a| *a == "--kv-transfer-config").expect("the flag stays");
        let config: serde_json::Value = serde_json::from_str(args[at + 1]).unwrap();
        assert_eq!(
            (&config["kv_connector"], &config["kv_connector_extra_config"]["inner"]["kv_connector"], &config["kv_load_failure_policy"]),
            (&serde_json::json!("KvgateConnector"), &serde_json::json!("NixlConnector"), &serde_json::json!("fail")),
            "{role}: {config}"
        );
        assert_eq!(config["kv_connector_extra_config"]["role"], role);
        assert_eq!(c["image"], "vllm/vllm-openai:v0.32.0", "{role}: the user's image");
        let volumes = pod["volumes"].to_string();
        assert!(volumes.contains(&format!("\"{name}\"")) && volumes.contains(&format!("\"{secret}\"")), "{role}: {volumes}");
        assert!(c["env"].to_string().contains("/opt/kvgate/python"), "{role}: PYTHONPATH: {}", c["env"]);
    }

    cp.kubectl_ok(&["-n", &ns, "delete", "configmap", &name]);
    eventually(cp, &ns, "the ConfigMap applied again", LONG, || config_maps().first().is_some_and(|c| c["metadata"]["uid"] != uid));
    assert_eq!(config_maps()[0]["metadata"]["name"], name.as_str());
}

#[test]
fn engine_specs_that_make_no_sense_are_refused_naming_the_field() {
    let (cp, _) = env();
    let ns = cp.namespace("engine-specs");
    let base = llamacpp(cp, "bad", 4096, &["-c", "4096"]);
    let rows = [
        (
            base.replace("  engine: llamacpp\n", "  engine: llamacpp\n  prefill: { kvPool: { tokens: 8 } }\n"),
            "llama.cpp has no disaggregated prefill/decode serving",
        ),
        (
            base.replace("engine: llamacpp", "engine: sglang")
                .replace("  rollout:", "  prefill: { container: { name: p } }\n  decode: { container: { name: d } }\n  rollout:"),
            "set exactly one of the two",
        ),
        (
            format!("{}  prefill: {{ container: {{ name: p }} }}\n  decode: {{ kvPool: {{ tokens: 8 }} }}\n", &base[..base.find("  server:").unwrap()])
                .replace("engine: llamacpp", "engine: vllm"),
            "spec.router.container are required",
        ),
        (base.replace("  model: { path: tiny.gguf,", "  model: { name: tiny, path: tiny.gguf,"), "spec.model"),
        (base.replace("  engine: llamacpp\n", "  engine: llamacpp\n  image: x\n"), "spec.image is kvgate's worker image"),
        (base[..base.find("  server:").unwrap()].to_string(), "an external engine serves from spec.server"),
        (base.replace("engine: llamacpp", "engine: tgi"), "spec.engine"),
        (base.replace("  model: { path: tiny.gguf,", "  model: { hub: org/model, path: tiny.gguf,"), "set exactly one of spec.model.name"),
        (base.replace("  model: { path: tiny.gguf,", "  model: { tokenSecret: { name: s, key: k }, path: tiny.gguf,"), "spec.model.tokenSecret"),
        (
            base.replace("    container:\n", "    podMetadata: { labels: { app.kubernetes.io/component: x } }\n    container:\n"),
            "keys under app.kubernetes.io/ and kvgate.dev/",
        ),
        (base.replace("    container:\n", "    volumes: [{ name: model, emptyDir: {} }]\n    container:\n"), "the names model, handoff-secret and api-keys"),
        (base.replace("    container:\n", "    volumeMounts: [{ name: x, mountPath: /models }]\n    container:\n"), "spec.server.volumeMounts"),
        (
            format!("{}  prefill: {{ verifyHandoff: true, container: {{ name: p }} }}\n  decode: {{ container: {{ name: d }} }}\n  router: {{ container: {{ name: r }} }}\n", &base[..base.find("  server:").unwrap()])
                .replace("engine: llamacpp", "engine: sglang"),
            "verifyHandoff is for engine vllm's prefill and decode",
        ),
        (
            format!("{}  prefill: {{ verifyHandoff: false, container: {{ name: p }} }}\n  decode: {{ container: {{ name: d }} }}\n  router: {{ container: {{ name: r }} }}\n", &base[..base.find("  server:").unwrap()])
                .replace("engine: llamacpp", "engine: vllm"),
            "spec.prefill.verifyHandoff and spec.decode.verifyHandoff must be equal",
        ),
    ];
    for (yaml, want) in rows {
        let (ok, err) = try_apply(cp, &ns, &yaml);
        assert!(!ok && err.contains(want), "applied, or not naming {want:?}: {err}");
    }
    // The engine is immutable.
    apply_yaml(cp, &ns, &base);
    let (ok, err) = try_apply(cp, &ns, &base.replace("engine: llamacpp", "engine: vllm"));
    assert!(!ok && err.contains("spec.engine is immutable"), "{err}");
}

/// An SGLang PD example (`examples/sglang-pd-incident.yaml`, `examples/sglang-pd.yaml`) as the
/// engine tests run it: each container (SGLang needs CUDA) swapped for
/// `tests/engines/sglang_server_info.py`, which answers SGLang's `/get_server_info` for the same
/// flags with `--max-total-tokens` as the pool a GPU measured; one pod per role, the model on
/// the tests' hostPath.
fn sglang_pd(cp: &ControlPlane, example: &str, name: &str, prefill_pool: u64, decode_pool: u64, canary: bool) -> String {
    let dir = models(cp);
    std::fs::copy(repo("tests/engines/sglang_server_info.py"), dir.join("sglang_server_info.py")).unwrap();
    let mut d: serde_json::Value = serde_yaml::from_str(&std::fs::read_to_string(repo(example)).unwrap()).unwrap();
    d["metadata"]["name"] = name.into();
    d["spec"]["model"]["volume"] = serde_json::json!({ "hostPath": dir.display().to_string() });
    for (role, pool) in [("prefill", prefill_pool), ("decode", decode_pool), ("router", 1)] {
        let r = &mut d["spec"][role];
        r["replicas"] = 1.into();
        let c = &mut r["container"];
        let mut args: Vec<serde_json::Value> = c["args"].as_array().unwrap().clone();
        if role == "router" {
            args = ["--model-path", "router", "--port", "30000"].map(serde_json::Value::from).to_vec();
        }
        args.extend(["--max-total-tokens".into(), pool.to_string().into()]);
        c["args"] = args.into();
        c["image"] = kvgate_testenv::images::llamacpp().into();
        c["command"] = serde_json::json!(["/usr/bin/python3.11", "/models/sglang_server_info.py"]);
        c.as_object_mut().unwrap().remove("resources");
    }
    if !canary {
        d["spec"]["rollout"] = serde_json::json!({ "canary": { "prompts": 0 }, "bakeSeconds": 0 });
    }
    serde_json::to_string(&d).unwrap()
}

/// The incident's own topology: SGLang prefill and decode disaggregated behind SGLang's router,
/// a 1,048,576-token window over prefill pools of 681,280. Refused before any request, naming the
/// role, the pod, SGLang's field and both numbers; a decode pool too small is named as decode's;
/// both large enough, the router takes traffic only once every pod it routes to is verified.
#[test]
fn the_incidents_disaggregated_sglang_is_refused_naming_its_prefill_pool() {
    let (cp, op) = env();
    let ns = models_namespace(cp, "sglang-pd");
    let incident = "examples/sglang-pd-incident.yaml";
    apply_yaml(cp, &ns, &sglang_pd(cp, incident, "incident", 681_280, 2_000_000, true));
    apply_yaml(cp, &ns, &sglang_pd(cp, incident, "small-decode", 2_000_000, 500_000, true));
    // examples/sglang-pd.yaml, sized to pass: the pools its first comment estimates.
    let sized = "examples/sglang-pd.yaml";
    apply_yaml(cp, &ns, &sglang_pd(cp, sized, "holds", 400_000, 400_000, false));
    let refused = |name: &str, role: &str, numbers: &str| {
        eventually(cp, &ns, &format!("{name} refused"), LONG, || condition_true(&infd(cp, &ns, name), "RolloutRefused"));
        let d = infd(cp, &ns, name);
        let r = &d["status"]["refusedRevision"];
        assert_eq!(r["reason"], "KVPoolBelowContextWindow", "{d}");
        let message = r["message"].as_str().unwrap();
        let pod = format!("sglang {role} pod {name}-{role}-{}-", r["revision"].as_str().unwrap());
        assert!(message.starts_with(&pod) && message.ends_with(&format!(": {numbers}")), "{message}");
        assert_eq!(d["status"]["phase"], "Refused");
        d
    };
    let d = refused("incident", "prefill", "max_total_num_tokens 681280 < contextWindow 1048576");
    // Refused at the first pod that fails: decode's pods may not have been read by then.
    assert_eq!(d["status"]["prefill"]["minMeasuredTokens"].as_u64(), Some(681_280), "{d}");
    refused("small-decode", "decode", "max_total_num_tokens 500000 < contextWindow 1048576");
    // The refused revisions never took traffic: their routers were never Ready.
    for name in ["incident", "small-decode"] {
        assert!(service_endpoints(cp, &ns, name).is_empty(), "{name}");
    }
    assert!(op.metric(r#"kvgate_operator_rollouts_refused_total{reason="KVPoolBelowContextWindow"}"#).unwrap_or(0.0) >= 2.0);

    // Both pools hold the window: the router passes the gate after its revision's pods did.
    eventually(cp, &ns, "holds Available", LONG, || infd(cp, &ns, "holds")["status"]["phase"] == "Available");
    let d = infd(cp, &ns, "holds");
    let rev = d["status"]["currentRevision"].as_str().unwrap().to_string();
    assert_eq!(d["status"]["ready"], "1/1/1", "{d}");
    let router = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/instance=holds,app.kubernetes.io/component=router"]);
    let router = &router["items"][0];
    let gate = router["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "kvgate.dev/kv-pool-verified").cloned().unwrap();
    assert_eq!((gate["status"].as_str(), gate["message"].as_str()), (Some("True"), Some("routes to 2 verified pods of its revision")), "{gate}");
    let ip = router["status"]["podIP"].as_str().unwrap();
    assert_eq!(service_endpoints(cp, &ns, "holds"), [format!("{ip}:30000")], "the Service fronts the router only");
    // It is told where its own revision's pods are: headless Services that publish them.
    let env = &router["spec"]["containers"][0]["env"];
    let host = env.as_array().unwrap().iter().find(|e| e["name"] == "KVGATE_PREFILL_HOST").unwrap()["value"].as_str().unwrap();
    assert_eq!(host, format!("holds-prefill-{rev}.{ns}.svc"));
    let svc = get_json(cp, &["-n", &ns, "get", "service", &format!("holds-prefill-{rev}")]);
    assert_eq!((svc["spec"]["clusterIP"].as_str(), svc["spec"]["selector"]["kvgate.dev/revision"].as_str()), (Some("None"), Some(rev.as_str())));

    // Deleted, the deployment's objects go; applied again, it comes back the same.
    cp.kubectl_ok(&["-n", &ns, "delete", "infd", "holds", "--wait=true"]);
    eventually(cp, &ns, "the revision's Services gone", LONG, || {
        get_json(cp, &["-n", &ns, "get", "services", "-l", "app.kubernetes.io/instance=holds"])["items"].as_array().is_some_and(|a| a.is_empty())
    });
    apply_yaml(cp, &ns, &sglang_pd(cp, sized, "holds", 400_000, 400_000, false));
    eventually(cp, &ns, "holds Available again", LONG, || infd(cp, &ns, "holds")["status"]["phase"] == "Available");
}

/// The request that broke production, asked before any traffic: engines that answer past their
/// window are refused `BoundaryProbeAnswered`, naming what came back. llama.cpp with
/// `--context-shift` keeps generating past `n_ctx` by dropping the prompt's oldest tokens; a front
/// end that answers a prompt its engine rejected with a one-token placeholder's tokens (the
/// incident's prefill) says 200 to a prompt of the window + 1; one that answers a prompt asked
/// again with the last other request's answer (the incident's decode) fails the stale-KV probe.
#[test]
fn engines_that_answer_past_their_window_or_from_stale_kv_are_refused_by_the_probes() {
    let (cp, op) = env();
    let ns = models_namespace(cp, "boundary");
    let dir = models(cp);
    std::fs::copy(repo("tests/engines/placeholder_front.py"), dir.join("placeholder_front.py")).unwrap();
    apply_yaml(cp, &ns, &llamacpp(cp, "shift", 4096, &["-c", "4096", "--context-shift"]));
    let front = llamacpp(cp, "placeholder", 4096, &["-c", "4096"]).replace(
        "      args: [",
        "      command: [\"/usr/bin/python3.11\", \"/models/placeholder_front.py\", \"--port\", \"8080\", \"--upstream-port\", \"8081\", \"--\", \"/usr/local/bin/llama-server\"]\n      args: [",
    );
    let front = front.replace("\"--port\", \"8080\", \"-c\"", "\"--port\", \"8081\", \"-c\"");
    apply_yaml(cp, &ns, &front);
    let stale =
        front.replace("name: placeholder", "name: stale").replace("\"--upstream-port\", \"8081\"", "\"--upstream-port\", \"8081\", \"--mode\", \"stale\"");
    apply_yaml(cp, &ns, &stale);
    let refused_for = |name: &str, reason: &str| {
        eventually(cp, &ns, &format!("{name} refused"), LONG, || condition_true(&infd(cp, &ns, name), "RolloutRefused"));
        let d = infd(cp, &ns, name);
        assert_eq!(d["status"]["refusedRevision"]["reason"], reason, "{d}");
        assert_eq!((d["status"]["canary"]["passed"].as_bool(), d["status"]["canary"]["reason"].as_str()), (Some(false), Some(reason)), "{d}");
        assert!(service_endpoints(cp, &ns, name).is_empty(), "{name} never took traffic");
        d["status"]["refusedRevision"]["message"].as_str().unwrap().to_string()
    };
    let refused = |name: &str| refused_for(name, "BoundaryProbeAnswered");
    let shifted = refused("shift");
    assert!(
        shifted.starts_with("llamacpp pod shift-server-")
            && shifted.contains(": a prompt of 4095 tokens asking for 8 more was answered with 8 tokens, 7 past contextWindow 4096"),
        "{shifted}"
    );
    let placeholder = refused("placeholder");
    assert!(placeholder.contains(": a prompt of 4097 tokens (contextWindow 4096 + 1) was answered with 1 tokens ["), "{placeholder}");
    assert!(op.metric(r#"kvgate_operator_rollouts_refused_total{reason="BoundaryProbeAnswered"}"#).unwrap_or(0.0) >= 2.0);
    assert!(op.metric(r#"kvgate_operator_probe_mismatches_total{engine="llamacpp",probe="boundary",role="server"}"#).unwrap_or(0.0) >= 2.0);
    // An engine that answers a prompt asked again with another request's answer: the stale-KV
    // probe (other prompts fill the pool, then the compared prompts again) refuses it.
    let stale = refused_for("stale", "CanaryFailed");
    assert!(stale.starts_with("stale KV: llamacpp pod stale-server-") && stale.contains("after 4 other prompts of 4088 tokens: output token 0 is"), "{stale}");
    assert!(op.metric(r#"kvgate_operator_probe_mismatches_total{engine="llamacpp",probe="stale_kv",role="server"}"#).unwrap_or(0.0) >= 1.0);
    eventually(cp, &ns, "a BoundaryProbeAnswered Event", Duration::from_secs(30), || {
        let evs = get_json(cp, &["-n", &ns, "get", "events", "--field-selector=reason=BoundaryProbeAnswered"]);
        evs["items"].as_array().is_some_and(|a| a.len() >= 2)
    });
}

/// The probes on serving pods, beside live traffic: an engine that passed its canary (here
/// without the stale-KV probe) and starts answering a prompt with another request's answer once
/// traffic flows is caught by the next round: its pod leaves the Service, the deployment is
/// Degraded naming it, the probe counter moves.
#[test]
fn a_serving_pod_answering_from_stale_kv_beside_live_traffic_is_taken_out() {
    let (cp, op) = env();
    let ns = models_namespace(cp, "serving-probes");
    let dir = models(cp);
    std::fs::copy(repo("tests/engines/placeholder_front.py"), dir.join("placeholder_front.py")).unwrap();
    let yaml = llamacpp(cp, "stale", 4096, &["-c", "4096"])
        .replace(
            "      args: [",
            "      command: [\"/usr/bin/python3.11\", \"/models/placeholder_front.py\", \"--port\", \"8080\", \"--upstream-port\", \"8081\", \"--mode\", \"stale\", \"--\", \"/usr/local/bin/llama-server\"]\n      args: [",
        )
        .replace("\"--port\", \"8080\", \"-c\"", "\"--port\", \"8081\", \"-c\"")
        .replace("  rollout: { bakeSeconds: 0 }", "  rollout: { bakeSeconds: 0, boundaryProbe: { staleKvFillers: 0, servingEverySeconds: 2 } }");
    apply_yaml(cp, &ns, &yaml);
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "stale")["status"]["phase"] == "Available");
    let server = service_endpoints(cp, &ns, "stale").pop().expect("a ready server");
    let before = op.metric(r#"kvgate_operator_probe_mismatches_total{engine="llamacpp",probe="stale_kv",role="server"}"#).unwrap_or(0.0);
    // Live traffic on the engine's own API, between the probe's rounds. It keeps flowing until
    // the pod is out: a round with no traffic between it and the last passes again, and the pod
    // goes back into the Service (by design), which a poll could otherwise miss.
    let live = || {
        let body = serde_json::json!({ "prompt": [5, 6, 7, 8], "n_predict": 4, "temperature": 0.0, "return_tokens": true }).to_string();
        let _ = request("POST", &format!("http://{server}/completion"), Some(&body));
    };
    eventually(cp, &ns, "Degraded by the serving probe", LONG, || {
        live();
        condition_true(&infd(cp, &ns, "stale"), "Degraded")
    });
    let d = infd(cp, &ns, "stale");
    let degraded = condition(&d, "Degraded").unwrap()["message"].as_str().unwrap().to_string();
    assert!(degraded.contains("stale KV: llamacpp pod stale-server-") && degraded.contains("beside live traffic"), "{degraded}");
    // The gate condition goes False in the pass that writes Degraded; the endpoint controller
    // takes the pod out of the Service right after.
    eventually(cp, &ns, "the caught pod out of the Service", Duration::from_secs(30), || {
        live();
        service_endpoints(cp, &ns, "stale").is_empty()
    });
    assert!(op.metric(r#"kvgate_operator_probe_mismatches_total{engine="llamacpp",probe="stale_kv",role="server"}"#).unwrap_or(0.0) > before);
}

/// kvgate's own workers from a GGUF file (the llama.cpp tests' tiny model: f32, a SentencePiece
/// vocabulary of bytes) on the models hostPath: every pod reads it, prefill and decode agree on
/// its fingerprint, the gate and the integrity canary pass, and the router answers.
#[test]
fn kvgates_workers_serve_a_gguf_file_through_the_gate_and_the_canary() {
    let (cp, _) = env();
    let ns = models_namespace(cp, "kvgate-gguf");
    let model = format!("model: {{ path: tiny.gguf, volume: {{ hostPath: {} }} }}", models(cp).display());
    apply_yaml(cp, &ns, &tiny("gguf", 2048, 4096, 4096, "").replace("model: { name: tiny }", &model));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "gguf")["status"]["phase"] == "Available");
    let d = infd(cp, &ns, "gguf");
    assert_eq!(d["status"]["canary"]["passed"], true, "{d}");
    assert_eq!(d["status"]["minMeasuredTokens"].as_u64(), Some(4096), "{d}");
    let router = router_endpoints(cp, &ns, "gguf").pop().expect("a ready router endpoint");
    let (status, body) = complete(&router, "Hello", 4).unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"model\":\"tiny.gguf\""), "the model is named by its file: {body}");
}

/// Every example is an object the API server accepts as written (each engine's among them).
#[test]
fn every_example_passes_the_api_servers_validation() {
    let (cp, _) = env();
    let ns = cp.namespace("examples");
    let mut checked = Vec::new();
    for entry in std::fs::read_dir(repo("examples")).unwrap().flatten() {
        let path = entry.path();
        let out = cp.kubectl(&["-n", &ns, "apply", "--dry-run=server", "-f", path.to_str().unwrap()]);
        assert!(out.status.success(), "{}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
        checked.push(entry.file_name().to_string_lossy().into_owned());
    }
    checked.sort();
    for want in
        ["gguf.yaml", "llamacpp.yaml", "sglang-gpu.yaml", "sglang-pd-incident.yaml", "sglang-pd.yaml", "tenants.yaml", "tiny.yaml", "vllm-pd.yaml", "vllm.yaml"]
    {
        assert!(checked.iter().any(|c| c == want), "{want} not among {checked:?}");
    }
}
