//! The same tokens as the reference: every checkpoint in `tests/fixtures/reference/` (written by
//! Hugging Face `transformers`, with its greedy continuations, see `make.py` there) is served by
//! `kvgate-worker local` colocated and split into router/prefill/decode, with the default and a
//! tiny step budget (prompts prefilled 4 tokens at a time), and must continue every prompt with
//! exactly the tokens `transformers` generated.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};
use support::Worker;

fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/reference");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("expected.json").is_file())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 16, "expected the reference fixtures under {} (tests/fixtures/reference/make.py writes them)", root.display());
    dirs
}

/// The word-level fixture tokenizer decodes token `i` as the word `t<i>`.
fn ids(text: &str) -> Vec<u32> {
    text.split_whitespace()
        .map(|w| w.strip_prefix('t').and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("not a fixture token: {w:?} in {text:?}")))
        .collect()
}

const MODES: &[(&str, &[&str])] = &[
    ("colocated", &["--colocated"]),
    ("colocated, 4-token steps", &["--colocated", "--max-batch-tokens=4"]),
    ("split", &[]),
    ("split, 4-token steps", &["--max-batch-tokens=4"]),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_reference_checkpoint_gives_the_reference_tokens_in_every_mode() {
    let mut failures = Vec::new();
    for dir in fixtures() {
        let expected: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
        let model = dir.to_str().unwrap();
        for (mode, flags) in MODES {
            let mut args = vec!["--model", model, "--context-window=64", "--kv-pool-tokens=256"];
            args.extend_from_slice(flags);
            let worker = Worker::local(&args);
            for case in expected["cases"].as_array().unwrap() {
                let want: Vec<u32> = serde_json::from_value(case["generated"].clone()).unwrap();
                let body = json!({ "prompt": case["prompt"], "max_tokens": want.len(), "temperature": 0 });
                let (status, resp) = worker.post("/v1/completions", &body).await;
                assert_eq!(status, 200, "{} ({mode}): {resp}", dir.display());
                let got = ids(resp["choices"][0]["text"].as_str().unwrap());
                if got != want {
                    failures.push(format!(
                        "{} ({mode}), prompt {}: got {got:?}, transformers {want:?}",
                        dir.file_name().unwrap().to_string_lossy(),
                        case["prompt"]
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} divergences:\n{}", failures.len(), failures.join("\n"));
}

/// Log-probabilities match the reference within this (f32 arithmetic in another order; measured
/// differences stay under 1e-5).
const LOGPROB_TOLERANCE: f64 = 1e-4;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn echo_with_logprobs_gives_the_references_log_probabilities_colocated_and_split() {
    let mut failures = Vec::new();
    for dir in fixtures() {
        let expected: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
        for (mode, flags) in [MODES[1], MODES[3]] {
            let mut args = vec!["--model", dir.to_str().unwrap(), "--context-window=64", "--kv-pool-tokens=256"];
            args.extend_from_slice(flags);
            let worker = Worker::local(&args);
            for case in expected["cases"].as_array().unwrap() {
                let generated = case["generated"].as_array().unwrap().len();
                let body = json!({ "prompt": case["prompt"], "max_tokens": generated, "temperature": 0, "logprobs": 1, "echo": true });
                let (status, resp) = worker.post("/v1/completions", &body).await;
                assert_eq!(status, 200, "{resp}");
                let got = resp["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap().clone();
                let want = case["logprobs"].as_array().unwrap();
                assert_eq!(got.len(), want.len(), "{} ({mode}): one log-probability per prompt and generated token", dir.display());
                assert!(got[0].is_null() && want[0].is_null(), "the first prompt token has none");
                for (i, (g, w)) in got.iter().zip(want).enumerate().skip(1) {
                    let (g, w) = (g.as_f64().unwrap(), w.as_f64().unwrap());
                    if (g - w).abs() > LOGPROB_TOLERANCE {
                        failures.push(format!(
                            "{} ({mode}) prompt {} position {i}: {g} vs transformers {w}",
                            dir.file_name().unwrap().to_string_lossy(),
                            case["prompt"]
                        ));
                    }
                }
                // Greedy: each generated token is the top-1 alternative at its position.
                let tops = resp["choices"][0]["logprobs"]["top_logprobs"].as_array().unwrap();
                let n = got.len();
                for i in n - generated..n {
                    let best = tops[i].as_object().unwrap().values().map(|v| v.as_f64().unwrap()).fold(f64::NEG_INFINITY, f64::max);
                    assert_eq!(best, got[i].as_f64().unwrap(), "greedy token {i} is not the top alternative");
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} log-probabilities off by more than {LOGPROB_TOLERANCE}:\n{}", failures.len(), failures.join("\n"));
}

/// A copy of a fixture with `config.json`'s field at `path` set to `value`.
fn variant(name: &str, path: &[&str], value: Value) -> PathBuf {
    let src = fixtures().into_iter().find(|d| d.ends_with("llama-f32-v5")).unwrap();
    let dst = std::env::temp_dir().join(format!("kvgate-fidelity-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    *path.iter().fold(&mut config, |v, key| &mut v[*key]) = value;
    std::fs::write(dst.join("config.json"), config.to_string()).unwrap();
    dst
}

#[test]
fn a_checkpoint_with_a_field_kvgate_does_not_implement_is_refused_at_load_naming_it() {
    let refusals: [(&str, &[&str], Value, &str); 4] = [
        ("yarn", &["rope_parameters"], json!({ "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0 }), "rope_parameters.rope_type"),
        ("act", &["hidden_act"], json!("gelu"), "hidden_act"),
        ("partial", &["rope_parameters", "partial_rotary_factor"], json!(0.5), "partial_rotary_factor"),
        ("unknown", &["logit_softcapping"], json!(30.0), "logit_softcapping"),
    ];
    for (name, path, value, field) in refusals {
        let dir = variant(name, path, value);
        let out = Command::new(Worker::bin()).args(["local", "--listen=127.0.0.1:0", "--model", dir.to_str().unwrap()]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: the worker started");
        assert!(err.contains(field), "{name}: the refusal does not name `{field}`: {err}");
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn split_roles_sample_the_first_token_as_colocated_does() {
    let dir = fixtures().into_iter().find(|d| d.ends_with("llama-f32-v5")).unwrap();
    let model = dir.to_str().unwrap();
    let colocated = Worker::local(&["--model", model, "--colocated"]);
    let split = Worker::local(&["--model", model]);
    let mut firsts = std::collections::BTreeSet::new();
    for seed in 1..=8 {
        let body = json!({ "prompt": [5, 9, 12], "max_tokens": 8, "temperature": 1.0, "seed": seed });
        let (a, b) = (colocated.post("/v1/completions", &body).await, split.post("/v1/completions", &body).await);
        assert_eq!((a.0, b.0), (200, 200), "{} / {}", a.1, b.1);
        let (a, b) = (ids(a.1["choices"][0]["text"].as_str().unwrap()), ids(b.1["choices"][0]["text"].as_str().unwrap()));
        assert_eq!(a, b, "seed {seed}: colocated and split differ");
        firsts.insert(a[0]);
    }
    assert!(firsts.len() > 1, "8 seeds at temperature 1 gave one first token {firsts:?}: not sampled");
}
