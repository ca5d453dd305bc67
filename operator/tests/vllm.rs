//! The gate in front of vLLM's real CPU build (the test image `ghcr.io/kvgate/vllm`, several GB:
//! `make test-vllm` builds it and runs these; docs/engines.md "vLLM" has their last result), serving a
//! random Llama in transformers' layout under runc like every pod here.
//!
//! `--max-model-len -1` makes vLLM fit the window to its KV cache without a word: with a 1 MiB
//! cache it serves 896 tokens, and a deployment declaring 2,048 is refused with vLLM's numbers.
//! With a cache that holds the window it is Available and answers through the Service.
//! Disaggregated (`examples/vllm-pd.yaml`: NIXL between a prefill and a decode vLLM, vLLM's
//! router in front), each role is read and refused on its own.

mod support;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use kvgate_testenv::ControlPlane;
use support::*;

/// vLLM takes a minute to start on two cores, after the node unpacked its 6 GB image.
const LONG: Duration = Duration::from_secs(600);

fn models(cp: &ControlPlane) -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = cp.dir.join("models");
        kvgate_testenv::models::write(kvgate_testenv::models::Format::Hf, &dir.join("tiny"));
        dir
    })
}

fn env() -> (&'static ControlPlane, &'static Operator) {
    assert!(kvgate_testenv::images::vllm_built(), "the vLLM test image is not built: run `make test-vllm` (it fetches the pinned wheels and builds it)");
    static OP: OnceLock<Operator> = OnceLock::new();
    let cp = cluster();
    let dir = models(cp).display().to_string();
    (cp, OP.get_or_init(|| Operator::start_with(cp, "operator-vllm", "lease-vllm", None, &[&format!("--allowed-host-paths={dir}")])))
}

/// Every vLLM server's flags here: the tiny model without a tokenizer, bf16, no CUDA graphs.
const BASE_FLAGS: [&str; 10] =
    ["--model", "/models/tiny", "--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager", "--host", "0.0.0.0", "--port", "8000"];

/// A vLLM deployment declaring `window`, started with `args` after the model flags.
fn vllm(cp: &ControlPlane, name: &str, window: u64, args: &[&str]) -> String {
    let args: Vec<String> = BASE_FLAGS.iter().chain(args).map(|a| format!("\"{a}\"")).collect();
    format!(
        "apiVersion: kvgate.dev/v1alpha1\nkind: InferenceDeployment\nmetadata: {{ name: {name} }}\nspec:\n  engine: vllm\n  contextWindow: {window}\n  model: {{ path: tiny, volume: {{ hostPath: {dir} }} }}\n  server:\n    replicas: 1\n    container:\n      name: vllm\n      image: {image}\n      args: [{args}]\n      env: [{{ name: HOME, value: /tmp }}]\n  rollout: {{ bakeSeconds: 0, canary: {{ prompts: 2, maxPromptTokens: 256 }} }}\n",
        dir = models(cp).display(),
        image = kvgate_testenv::images::vllm(),
        args = args.join(", "),
    )
}

#[test]
fn a_window_vllm_fitted_to_its_cache_is_refused_with_vllms_numbers() {
    let (cp, _) = env();
    let ns = models_namespace(cp, "vllm-autofit");
    apply_yaml(cp, &ns, &vllm(cp, "autofit", 2048, &["--max-model-len", "-1", "--kv-cache-memory-bytes", "1048576"]));
    eventually(cp, &ns, "RolloutRefused", LONG, || condition_true(&infd(cp, &ns, "autofit"), "RolloutRefused"));
    let d = infd(cp, &ns, "autofit");
    let message = d["status"]["refusedRevision"]["message"].as_str().unwrap();
    assert!(message.starts_with("vllm pod autofit-server-") && message.ends_with(": max_model_len 896 < contextWindow 2048"), "{message}");
    assert_eq!((d["status"]["phase"].as_str(), d["status"]["minMeasuredTokens"].as_u64()), (Some("Refused"), Some(896)), "{d}");
}

#[test]
fn a_cache_that_holds_the_window_is_available_and_answers_through_the_service() {
    let (cp, _) = env();
    let ns = models_namespace(cp, "vllm-holds");
    apply_yaml(cp, &ns, &vllm(cp, "holds", 2048, &["--max-model-len", "2048", "--kv-cache-memory-bytes", "67108864"]));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "holds")["status"]["phase"] == "Available");
    let d = infd(cp, &ns, "holds");
    assert_eq!((d["status"]["minMeasuredTokens"].as_u64(), d["status"]["canary"]["passed"].as_bool()), (Some(2048), Some(true)), "{d}");
    let server = service_endpoints(cp, &ns, "holds").pop().expect("a ready vLLM endpoint");
    let body =
        serde_json::json!({ "model": "/models/tiny", "prompt": [1, 50, 60, 70, 80], "max_tokens": 4, "temperature": 0, "return_token_ids": true }).to_string();
    let (status, answer) = request("POST", &format!("http://{server}/v1/completions"), Some(&body)).unwrap();
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains("\"token_ids\""), "{answer}");
}

/// `examples/vllm-pd.yaml` on these CPUs: each role's container swapped for the test image with
/// the tiny model, `prefill` and `decode` the flags of each role's KV pool, one pod per role.
fn vllm_pd(cp: &ControlPlane, window: u64, prefill: &[&str], decode: &[&str]) -> String {
    vllm_pd_leased(cp, window, prefill, decode, 120)
}

/// `vllm_pd` whose connector holds each request's KV for decode `lease` seconds.
fn vllm_pd_leased(cp: &ControlPlane, window: u64, prefill: &[&str], decode: &[&str], lease: u64) -> String {
    let mut d: serde_json::Value = serde_yaml::from_str(&std::fs::read_to_string(repo("examples/vllm-pd.yaml")).unwrap()).unwrap();
    d["spec"]["contextWindow"] = window.into();
    d["spec"]["model"] = serde_json::json!({ "path": "tiny", "volume": { "hostPath": models(cp).display().to_string() } });
    d["spec"]["rollout"] = serde_json::json!({ "bakeSeconds": 0, "canary": { "prompts": 2, "maxPromptTokens": 512 } });
    for (role, pool) in [("prefill", prefill), ("decode", decode), ("router", &[][..])] {
        let r = &mut d["spec"][role];
        r["replicas"] = 1.into();
        let c = &mut r["container"];
        c["image"] = kvgate_testenv::images::vllm().into();
        c.as_object_mut().unwrap().remove("resources");
        if role == "router" {
            c["command"] = serde_json::json!(["/usr/bin/python3.11", "-m", "vllm_router.launch_router"]);
            continue;
        }
        // The example's connector, its buffers in host memory (there is no GPU here). Two
        // vLLMs share two cores: one UCX thread each (not 4, all polling), and a KV lease of
        // 120 s (not 30): with vLLM's default processes, reads took up to 81 s here, and past
        // its lease prefill frees blocks that decode may still read
        // (vllm:nixl_num_notifications_after_expiry).
        let args = c["args"].as_array().unwrap();
        let at = args.iter().position(|a| a == "--kv-transfer-config").unwrap();
        let mut connector: serde_json::Value = serde_json::from_str(args[at + 1].as_str().unwrap()).unwrap();
        connector["kv_buffer_device"] = "cpu".into();
        connector["kv_connector_extra_config"] = serde_json::json!({ "num_threads": 1, "kv_lease_duration": lease });
        // One process per server (engine and worker in the API server's): each process of a
        // vLLM polls, and two of them per role starve the others on two cores.
        let mut args: Vec<String> = BASE_FLAGS.map(String::from).to_vec();
        args.extend(["--distributed-executor-backend".into(), "uni".into()]);
        args.extend(["--kv-transfer-config".into(), connector.to_string()]);
        args.extend(pool.iter().map(|a| a.to_string()));
        c["args"] = args.into();
        let env = c["env"].as_array_mut().unwrap();
        env.push(serde_json::json!({ "name": "HOME", "value": "/tmp" }));
        env.push(serde_json::json!({ "name": "UCX_TLS", "value": "tcp,self" }));
        env.push(serde_json::json!({ "name": "VLLM_ENABLE_V1_MULTIPROCESSING", "value": "0" }));
    }
    serde_json::to_string(&d).unwrap()
}

/// The incident's topology on a real engine: vLLM's prefill and decode servers joined by its
/// NixlConnector (NIXL over UCX, TCP between the pods), vLLM's router in front, every role gated
/// on its own. A decode pool below the window is refused naming decode, then a prefill pool
/// below it naming prefill; with both large enough the revision is Available, answers through
/// the Service what a whole vLLM answers alone, and decode computed none of those prompts: their
/// KV came from prefill; kvgate's connector sealed every block prefill sent and decode verified
/// each. Then each transport fault of the connector's test switch (a changed byte, a block of
/// another request, a block never sent, a transfer past its lease) on its own revision is
/// refused by the canary from decode's counter, and a revision that goes bad after its canary
/// is rolled back in its bake; no answer is built on bad KV.
#[test]
fn a_disaggregated_vllm_is_gated_role_by_role_and_answers_with_kv_moved_by_nixl() {
    let (cp, _) = env();
    let ns = models_namespace(cp, "vllm-pd");
    let small = ["--max-model-len", "-1", "--kv-cache-memory-bytes", "1048576"];
    let holds = ["--max-model-len", "2048", "--kv-cache-memory-bytes", "67108864"];
    let refused = |role: &str| {
        eventually(cp, &ns, &format!("refused naming {role}"), LONG, || {
            infd(cp, &ns, "vllm-pd")["status"]["refusedRevision"]["message"].as_str().is_some_and(|m| m.starts_with(&format!("vllm {role} pod")))
        });
        let d = infd(cp, &ns, "vllm-pd");
        let message = d["status"]["refusedRevision"]["message"].as_str().unwrap().to_string();
        assert!(message.starts_with(&format!("vllm {role} pod vllm-pd-{role}-")) && message.ends_with(": max_model_len 896 < contextWindow 2048"), "{message}");
        assert!(condition_true(&d, "RolloutRefused"), "{d}");
        assert!(service_endpoints(cp, &ns, "vllm-pd").is_empty(), "a refused revision never takes traffic");
    };
    apply_yaml(cp, &ns, &vllm_pd(cp, 2048, &holds, &small));
    refused("decode");
    apply_yaml(cp, &ns, &vllm_pd(cp, 2048, &small, &holds));
    refused("prefill");
    apply_yaml(cp, &ns, &vllm_pd(cp, 2048, &holds, &holds));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "vllm-pd")["status"]["phase"] == "Available");
    let d = infd(cp, &ns, "vllm-pd");
    assert_eq!(d["status"]["ready"], "1/1/1", "{d}");
    assert_eq!(d["status"]["canary"]["passed"], true, "{d}");
    for role in ["prefill", "decode"] {
        assert_eq!(d["status"][role]["minMeasuredTokens"].as_u64(), Some(2048), "{role}: {d}");
    }
    let rev = d["status"]["currentRevision"].as_str().unwrap().to_string();
    let pod_of = |role: &str, rev: &str| {
        let pods = get_json(
            cp,
            &["-n", &ns, "get", "pods", "-l", &format!("app.kubernetes.io/instance=vllm-pd,app.kubernetes.io/component={role},kvgate.dev/revision={rev}")],
        );
        format!("{}:8000", pods["items"][0]["status"]["podIP"].as_str().unwrap_or_else(|| panic!("no {role} pod: {pods}")))
    };
    let (prefill, decode) = (pod_of("prefill", &rev), pod_of("decode", &rev));
    let router = service_endpoints(cp, &ns, "vllm-pd");
    assert_eq!(router.len(), 1, "the Service fronts the router alone: {router:?}");
    // The sum of a metric's samples that carry `label`.
    let metric = |pod: &str, name: &str, label: &str| -> f64 {
        let (status, body) = request("GET", &format!("http://{pod}/metrics"), None).unwrap();
        assert_eq!(status, 200, "{body}");
        let samples: Vec<f64> =
            body.lines().filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label)).filter_map(|l| l.rsplit(' ').next()?.parse().ok()).collect();
        assert!(!samples.is_empty(), "{pod} exports no {name} with {label:?}");
        samples.iter().sum()
    };
    let transferred = || metric(&decode, "vllm:prompt_tokens_by_source_total", r#"source="external_kv_transfer""#);
    // kvgate's connector, which the operator put around NixlConnector: blocks prefill sealed and
    // decode verified.
    let sealed = || metric(&prefill, "kvgate_handoff_sealed_total", r#"engine="vllm""#);
    let verified = || metric(&decode, "kvgate_handoff_verified_total", r#"engine="vllm""#);
    let (before, sealed_before, verified_before) = (transferred(), sealed(), verified());
    let mut prompt_tokens = 0;
    for len in [129u32, 300, 700] {
        let prompt: Vec<u32> = (0..len).map(|i| (i * 37 + len) % 500 + 3).collect();
        let body = serde_json::json!({ "model": "/models/tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": true }).to_string();
        let tokens = |at: &str| {
            let (status, answer) = request("POST", &format!("http://{at}/v1/completions"), Some(&body)).unwrap();
            assert_eq!(status, 200, "{at}: {answer}");
            let parsed: serde_json::Value = serde_json::from_str(&answer).unwrap();
            let ids = parsed["choices"][0]["token_ids"].as_array().unwrap_or_else(|| panic!("{at}: no choices[0].token_ids in {answer}"));
            ids.iter().map(|t| t.as_u64().unwrap()).collect::<Vec<_>>()
        };
        let (split, whole) = (tokens(&router[0]), tokens(&prefill));
        assert_eq!((split.len(), &split), (6, &whole), "a prompt of {len} tokens: through the router vs one vLLM alone");
        prompt_tokens += len;
    }
    // Every prompt token of those requests reached decode as KV pulled from prefill.
    let moved = transferred() - before;
    assert!(moved >= f64::from(prompt_tokens), "decode received KV for {moved} prompt tokens, the requests had {prompt_tokens}");
    // Every block prefill sealed, decode verified: those of the three prompts (vLLM's CPU blocks
    // hold 128 tokens: 2 + 3 + 6), and of any serving-probe round that ran meanwhile.
    let (sealed, verified) = (sealed() - sealed_before, verified() - verified_before);
    assert!(sealed == verified && sealed >= 11.0, "blocks sealed by prefill {sealed}, verified by decode {verified}: both must be the same, at least 11");
    assert_eq!(metric(&decode, "kvgate_handoff_mismatch_total", r#"engine="vllm""#), 0.0, "no handoff refused");
    assert_eq!(metric(&decode, "vllm:nixl_num_failed_transfers_total", ""), 0.0, "no NIXL transfer failed");
    // The series KvgateEngineKVReadAfterExpiry (dashboards/alerts.yaml) watches: exported by a
    // real vLLM prefill (`metric` fails if not), and still 0.
    assert_eq!(metric(&prefill, "vllm:nixl_num_notifications_after_expiry_total", ""), 0.0, "decode never read blocks prefill had freed");

    // What the good revision answers a probe prompt, alone.
    let probe: Vec<u32> = (0..300u32).map(|i| (i * 11 + 7) % 500 + 3).collect();
    let probe_body = serde_json::json!({ "model": "/models/tiny", "prompt": probe, "max_tokens": 6, "temperature": 0, "return_token_ids": true }).to_string();
    let reference = request("POST", &format!("http://{prefill}/v1/completions"), Some(&probe_body)).unwrap().1;
    let reference = serde_json::from_str::<serde_json::Value>(&reference).unwrap()["choices"][0]["token_ids"].clone();
    // A revision with one of the connector's test-only faults on `role`, from handoff `after` on.
    let faulty = |fault: &str, role: &str, after: u32, bake: u64, lease: u64| {
        let mut d: serde_json::Value = serde_json::from_str(&vllm_pd_leased(cp, 2048, &holds, &holds, lease)).unwrap();
        let env = d["spec"][role]["container"]["env"].as_array_mut().unwrap();
        env.push(serde_json::json!({ "name": "KVGATE_VLLM_FAULT", "value": fault }));
        env.push(serde_json::json!({ "name": "KVGATE_VLLM_FAULT_AFTER", "value": after.to_string() }));
        d["spec"]["rollout"]["bakeSeconds"] = bake.into();
        d.to_string()
    };
    let ask = |at: &str, body: &str| request("POST", &format!("http://{at}/v1/completions"), Some(body)).unwrap();
    // Each fault of the transport, on its own revision: refused by the canary naming decode's
    // counter and its reason, while the good revision serves on and answers what it answered.
    // `late` holds a finished transfer until prefill's lease ran out: a lease of 30 s (not
    // 120), so the canary's first request (120 s at most) meets it.
    let mut refused = serde_json::Value::Null;
    for (fault, role, reason, lease) in [
        ("corrupt", "decode", "checksum", 120),
        ("foreign", "prefill", "checksum", 120),
        ("unsent", "decode", "checksum", 120),
        ("late", "decode", "timeout", 30),
    ] {
        let earlier = infd(cp, &ns, "vllm-pd")["status"]["refusedRevision"]["revision"].clone();
        apply_yaml(cp, &ns, &faulty(fault, role, 0, 0, lease));
        eventually(cp, &ns, &format!("the revision with fault {fault} refused"), LONG, || {
            let d = infd(cp, &ns, "vllm-pd");
            d["status"]["refusedRevision"]["revision"].is_string() && d["status"]["refusedRevision"]["revision"] != earlier
        });
        let d = infd(cp, &ns, "vllm-pd");
        refused = d["status"]["refusedRevision"].clone();
        assert_eq!(
            (refused["reason"].as_str(), refused["rolledBack"].as_bool(), d["status"]["phase"].as_str()),
            (Some("HandoffIntegrityViolation"), None, Some("Refused")),
            "{fault}: {d}"
        );
        let message = refused["message"].as_str().unwrap();
        assert!(message.contains("vllm pod vllm-pd-decode-") && message.contains(&format!("(decode): {reason} 0 -> ")), "{fault}: {message}");
        assert_eq!(d["status"]["currentRevision"], rev.as_str(), "{fault}: the good revision still serves: {d}");
        let (status, answer) = ask(&service_endpoints(cp, &ns, "vllm-pd")[0], &probe_body);
        assert_eq!(status, 200, "{answer}");
        assert_eq!(serde_json::from_str::<serde_json::Value>(&answer).unwrap()["choices"][0]["token_ids"], reference);
    }

    // A revision that goes bad after its canary (the fault after 12 handoffs per decode pod):
    // promoted, then rolled back in its bake from decode's own counter; no answer carries
    // tokens built on the bad KV (each is the reference's, or an error).
    apply_yaml(cp, &ns, &faulty("corrupt", "decode", 12, 600, 120));
    let mut baking = serde_json::Value::Null;
    eventually(cp, &ns, "the revision that goes bad promoted and baking", LONG, || {
        baking = infd(cp, &ns, "vllm-pd");
        assert!(
            baking["status"]["refusedRevision"]["revision"] == refused["revision"],
            "refused before its bake (its canary used more than 12 handoffs?): {baking}"
        );
        baking["status"]["phase"] == "Baking"
    });
    let promoted = baking["status"]["currentRevision"].as_str().unwrap().to_string();
    // Through the promoted revision's own router: while it bakes, the Service fronts the
    // previous revision's router too.
    let promoted_router = pod_of("router", &promoted);
    let (mut served, mut failed) = (0, 0);
    for _ in 0..40 {
        if infd(cp, &ns, "vllm-pd")["status"]["phase"] == "RolledBack" {
            break;
        }
        let (status, answer) = ask(&promoted_router, &probe_body);
        if status == 200 {
            assert_eq!(serde_json::from_str::<serde_json::Value>(&answer).unwrap()["choices"][0]["token_ids"], reference, "a 200 from the bad revision");
            served += 1;
        } else {
            failed += 1;
        }
    }
    eventually(cp, &ns, "RolledBack", LONG, || infd(cp, &ns, "vllm-pd")["status"]["phase"] == "RolledBack");
    let d = infd(cp, &ns, "vllm-pd");
    assert_eq!(d["status"]["currentRevision"], rev.as_str(), "the good revision serves again: {d}");
    let rolled = &d["status"]["refusedRevision"];
    assert_eq!((rolled["revision"].as_str(), rolled["reason"].as_str()), (Some(promoted.as_str()), Some("HandoffIntegrityViolation")), "{d}");
    assert!(rolled["message"].as_str().unwrap().contains("checksum"), "{rolled}");
    assert_eq!(rolled["rolledBack"], true, "{rolled}");
    assert!(failed >= 1, "{served} served, {failed} failed: the fault never hit");
}

/// vLLM behind a front end that asks it to truncate every prompt to what it holds (vLLM's own
/// `truncate_prompt_tokens: -1`, `tests/engines/placeholder_front.py --mode truncate`): vLLM's
/// numbers hold the window, but a prompt of the window + 1 is answered 200 over its last tokens.
/// The boundary probe refuses the revision before any traffic.
#[test]
fn a_vllm_whose_front_end_truncates_long_prompts_is_refused_by_the_boundary_probe() {
    let (cp, _) = env();
    let ns = models_namespace(cp, "vllm-truncate");
    std::fs::copy(repo("tests/engines/placeholder_front.py"), models(cp).join("placeholder_front.py")).unwrap();
    let front = vllm(cp, "truncate", 2048, &["--max-model-len", "2048", "--kv-cache-memory-bytes", "67108864"])
        .replace(
            "      args: [",
            "      command: [\"/usr/bin/python3.11\", \"/models/placeholder_front.py\", \"--port\", \"8000\", \"--upstream-port\", \"8001\", \"--mode\", \"truncate\", \"--truncate\", \"-1\", \"--\", \"-m\", \"vllm.entrypoints.openai.api_server\"]\n      args: [",
        )
        .replace("\"--port\", \"8000\", \"--max-model-len\"", "\"--port\", \"8001\", \"--max-model-len\"");
    assert!(front.contains("\"8001\", \"--max-model-len\""), "{front}");
    apply_yaml(cp, &ns, &front);
    eventually(cp, &ns, "truncate refused", LONG, || condition_true(&infd(cp, &ns, "truncate"), "RolloutRefused"));
    let d = infd(cp, &ns, "truncate");
    assert_eq!(
        (d["status"]["refusedRevision"]["reason"].as_str(), d["status"]["minMeasuredTokens"].as_u64()),
        (Some("BoundaryProbeAnswered"), Some(2048)),
        "{d}"
    );
    let message = d["status"]["refusedRevision"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("vllm pod truncate-server-") && message.contains(": a prompt of 2049 tokens (contextWindow 2048 + 1) was answered with 1 tokens ["),
        "{message}"
    );
    assert!(service_endpoints(cp, &ns, "truncate").is_empty(), "never took traffic");
}
