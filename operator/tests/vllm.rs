//! The gate in front of vLLM's real CPU build (the test image `ghcr.io/kvgate/vllm`, several GB:
//! `make test-vllm` builds it and runs these; README "vLLM" has their last result), serving a
//! random Llama in transformers' layout under runc like every pod here.
//!
//! `--max-model-len -1` makes vLLM fit the window to its KV cache without a word: with a 1 MiB
//! cache it serves 896 tokens, and a deployment declaring 2,048 is refused with vLLM's numbers.
//! With a cache that holds the window it is Available and answers through the Service.

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
        let out = std::process::Command::new("bash").arg(repo("tests/engines/models.sh")).arg("hf").arg(dir.join("tiny")).output().unwrap();
        assert!(out.status.success(), "writing the model: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
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

/// A vLLM deployment declaring `window`, started with `args` after the model flags.
fn vllm(cp: &ControlPlane, name: &str, window: u64, args: &[&str]) -> String {
    let base = ["--model", "/models/tiny", "--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager", "--host", "0.0.0.0", "--port", "8000"];
    let args: Vec<String> = base.iter().chain(args).map(|a| format!("\"{a}\"")).collect();
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
