//! The same tokens as the reference: every checkpoint in `tests/fixtures/reference/` (written by
//! Hugging Face `transformers`, with its greedy continuations, see `make.py` there) is served by
//! `kvgate-worker local` colocated and split into router/prefill/decode, with the default and a
//! tiny step budget (prompts prefilled 4 tokens at a time), and must continue every prompt with
//! exactly the tokens `transformers` generated.
//!
//! The GGUF files in `tests/fixtures/gguf-reference/` (Q8_0 and Q4_K_M's mix) are compared with
//! what transformers computes on the weights it dequantizes from the same files: kvgate keeps
//! the blocks and quantizes each product's input rows to 8 bits (as llama.cpp does), so
//! log-probabilities agree within `GGUF_LOGPROB_BOUND`, not bit for bit, and greedy tokens agree
//! until transformers itself is near a tie.

#[path = "support/gguf_files.rs"]
mod gguf_files;
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};
use support::Worker;

/// The entries of `tests/fixtures/<dir>` that `keep` keeps, in order.
fn fixture_entries(dir: &str, keep: impl Fn(&Path) -> bool) -> (PathBuf, Vec<PathBuf>) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(dir);
    let mut found: Vec<PathBuf> =
        std::fs::read_dir(&root).unwrap_or_else(|e| panic!("{}: {e}", root.display())).flatten().map(|e| e.path()).filter(|p| keep(p)).collect();
    found.sort();
    (root, found)
}

fn fixtures() -> Vec<PathBuf> {
    let (root, dirs) = fixture_entries("reference", |p| p.join("expected.json").is_file());
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

fn gguf_fixtures() -> Vec<PathBuf> {
    let (root, files) = fixture_entries("gguf-reference", |p| p.extension().is_some_and(|e| e == "gguf"));
    assert_eq!(files.len(), 4, "expected Llama and Qwen2 in Q8_0 and Q4_K_M under {} (make.py there writes them)", root.display());
    files
}

/// Teacher-forced log-probabilities agree with transformers' on the dequantized weights within
/// this (nats; the 8-bit rounding of each product's input, printed as measured).
const GGUF_LOGPROB_BOUND: f64 = 0.1;

/// The fixtures' vocabulary (`worker/examples/gguf_fixtures.rs`).
const GGUF_VOCAB: usize = 300;

/// Where transformers' own top two are closer than this (nats), the rounding decides between
/// them (as against llama.cpp in tests/gguf.rs).
const GGUF_NEAR_TIE: f64 = 0.1;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gguf_file_gives_transformers_log_probabilities_on_its_dequantized_weights() {
    let mut failures = Vec::new();
    let (mut full, mut cases) = (0, 0);
    let mut worst_of_all = 0.0f64;
    for file in gguf_fixtures() {
        let mut worst = 0.0f64;
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let expected: Value = serde_json::from_str(&std::fs::read_to_string(file.with_extension("json")).unwrap()).unwrap();
        let bytes = std::fs::read(&file).unwrap();
        assert_eq!(
            sha256_hex(&bytes),
            expected["sha256"].as_str().unwrap(),
            "{name} is not the file transformers read: rerun tests/fixtures/gguf-reference/make.py"
        );
        let model = file.to_str().unwrap();
        for (mode, flags) in [MODES[0], MODES[2]] {
            let mut args = vec!["--model", model, "--context-window=256", "--kv-pool-tokens=1024"];
            args.extend_from_slice(flags);
            let worker = Worker::local(&args);
            for case in expected["cases"].as_array().unwrap() {
                let prompt: Vec<u32> = serde_json::from_value(case["prompt"].clone()).unwrap();
                let generated: Vec<u32> = serde_json::from_value(case["generated"].clone()).unwrap();
                let label = format!("{name} ({mode}), {}-token prompt", prompt.len());
                // Teacher-forced: transformers' whole sequence as the prompt, echoed with each
                // token's log-probability given the tokens before it.
                let seq: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
                let body = json!({ "prompt": seq, "max_tokens": 1, "temperature": 0, "logprobs": 0, "echo": true });
                let (status, resp) = worker.post("/v1/completions", &body).await;
                assert_eq!(status, 200, "{label}: {resp}");
                let got = resp["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap();
                let want = case["logprobs"].as_array().unwrap();
                assert_eq!((want.len(), got.len()), (seq.len(), seq.len() + 1), "{label}: one log-probability per token (and kvgate's one generated)");
                assert!(got[0].is_null() && want[0].is_null(), "{label}: the first token has no log-probability");
                for (i, (g, w)) in got.iter().zip(want).enumerate().skip(1) {
                    let (g, w) = (g.as_f64().unwrap(), w.as_f64().unwrap());
                    worst = worst.max((g - w).abs());
                    if (g - w).abs() > GGUF_LOGPROB_BOUND {
                        failures.push(format!("{label} position {i}: {g} vs transformers {w}"));
                    }
                }
                // Greedy: the same tokens until transformers is near a tie.
                let body = json!({ "prompt": prompt, "max_tokens": generated.len(), "temperature": 0, "ignore_eos": true, "logprobs": 0 });
                let (status, resp) = worker.post("/v1/completions", &body).await;
                assert_eq!(status, 200, "{label}: {resp}");
                let pieces = resp["choices"][0]["logprobs"]["tokens"].as_array().unwrap();
                let got: Vec<Option<u32>> = pieces.iter().map(|p| gguf_files::piece(p.as_str().unwrap(), GGUF_VOCAB)).collect();
                let same = got.iter().zip(&generated).take_while(|(a, b)| **a == gguf_files::key(**b)).count();
                cases += 1;
                if same == generated.len() {
                    full += 1;
                    continue;
                }
                let top: Vec<(u32, f64)> = serde_json::from_value(case["top"][same].clone()).unwrap();
                let behind = top.iter().find(|(id, _)| gguf_files::key(*id) == got[same]).map(|(_, lp)| top[0].1 - lp);
                println!(
                    "{label}: {same}/{} tokens as transformers; then kvgate {:?}, transformers {} ({behind:.4?} nats behind)",
                    generated.len(),
                    got[same],
                    generated[same]
                );
                if !behind.is_some_and(|b| b < GGUF_NEAR_TIE) {
                    failures.push(format!(
                        "{label}: kvgate's token {same} ({:?}) is not within {GGUF_NEAR_TIE} nats of transformers' ({})",
                        got[same], generated[same]
                    ));
                }
            }
        }
        println!("{name}: log-probabilities within {worst:.4} nats of transformers'");
        worst_of_all = worst_of_all.max(worst);
    }
    println!("GGUF vs transformers on the dequantized weights: {full}/{cases} continuations in full; log-probabilities within {worst_of_all:.4} nats");
    assert!(failures.is_empty(), "{} differences from transformers:\n{}", failures.len(), failures.join("\n"));
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}
