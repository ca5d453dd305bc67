//! Real clients against real workers: the official `openai` Python client exercising `stop`,
//! `logprobs`, `top_logprobs`, `echo`, `n`, token-id prompts and a refused field
//! (`tests/clients/openai_fields.py`), colocated and split; and lm-evaluation-harness's
//! `local-completions` running a log-likelihood task whose numbers must equal those computed
//! from transformers' (`tests/clients/lm_eval_check.py`). Both come from `target/pyenv`, which
//! `make test-deps` (`scripts/py-deps.sh`) creates.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use support::Worker;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn python() -> PathBuf {
    let p = repo().join("target/pyenv/bin/python");
    assert!(p.is_file(), "{} not found: run `make test-deps` (scripts/py-deps.sh installs the openai client and lm-eval there)", p.display());
    p
}

fn fixture() -> String {
    repo().join("tests/fixtures/reference/llama-f32-v5").to_str().unwrap().to_string()
}

fn run(script: &str, args: &[&str]) -> String {
    let out = Command::new(python()).arg(repo().join("tests/clients").join(script)).args(args).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{script} failed:\n{stdout}\n{stderr}");
    stdout.into_owned()
}

#[test]
fn the_official_openai_client_uses_every_field_colocated_and_split() {
    let model = fixture();
    for flags in [&["--colocated"][..], &[][..]] {
        let mut args = vec!["--model", model.as_str(), "--context-window=64", "--kv-pool-tokens=512"];
        args.extend_from_slice(flags);
        let worker = Worker::local(&args);
        let out = run("openai_fields.py", &[&worker.base]);
        assert_eq!(out.lines().filter(|l| l.starts_with("ok: ")).count(), 11, "{out}");
    }
}

#[test]
fn lm_evaluation_harness_log_likelihoods_equal_the_reference() {
    let model = fixture();
    let worker = Worker::local(&["--model", model.as_str(), "--context-window=64", "--kv-pool-tokens=512"]);
    let work = std::env::temp_dir().join(format!("kvgate-lm-eval-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let out = run("lm_eval_check.py", &[&model, &worker.base, work.to_str().unwrap()]);
    let result: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(result["docs"], 6, "{result}");
    assert_eq!(result["acc"], result["reference_acc"], "{result}");
    let _ = std::fs::remove_dir_all(&work);
}
