//! `cargo xtask bench NAME -- COMMAND` keeps what a benchmark printed with the facts of its run,
//! and keeps the previous results when the command fails or prints no table.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn xtask(results: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xtask")).env("KVGATE_BENCH_RESULTS", results).args(args).output().unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvgate-bench-data-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn head() -> String {
    let out = Command::new("git").args(["rev-parse", "HEAD"]).current_dir(env!("CARGO_MANIFEST_DIR")).output().unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn a_run_keeps_its_tables_with_commit_date_cpu_and_load() {
    let dir = scratch("run");
    let script =
        "echo warming up; printf '| bench | result |\\n| --- | ---: |\\n| row one | 1.50x |\\n\\n(a note)\\n| other | n |\\n| --- | --- |\\n| two | 2 |\\n'";
    let out = xtask(&dir, &["bench", "probe", "--", "sh", "-c", script]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The output passes through as the benchmark printed it.
    assert!(String::from_utf8_lossy(&out.stdout).contains("warming up\n| bench | result |"));
    let kept: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("probe.json")).unwrap()).unwrap();
    assert_eq!(kept["bench"], "probe");
    assert_eq!(kept["command"], format!("sh -c {script}"));
    let run = &kept["run"];
    assert_eq!(run["commit"], head());
    let date = run["date"].as_str().unwrap();
    assert!(date.len() == 16 && date.starts_with("20") && date.as_bytes()[10] == b' ', "{date}");
    assert!(!run["cpu"].as_str().unwrap().is_empty());
    assert!(run["cores"].as_u64().unwrap() >= 1);
    assert!(run["flags"].is_array());
    assert!(run["load_before"].as_f64().is_some() && run["load_after"].as_f64().is_some());
    assert!(run["seconds"].as_f64().unwrap() >= 0.0);
    assert!(run.get("note").is_none(), "a measured run carries no import note");
    let tables = kept["tables"].as_array().unwrap();
    assert_eq!(tables.len(), 2);
    assert_eq!(tables[0]["align"], serde_json::json!(["---", "---:"]));
    assert_eq!(tables[0]["rows"], serde_json::json!([["row one", "1.50x"]]));
    assert_eq!(tables[1]["rows"], serde_json::json!([["two", "2"]]));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_failed_or_tableless_run_keeps_the_previous_results() {
    let dir = scratch("fail");
    std::fs::write(dir.join("probe.json"), "previous").unwrap();
    let out = xtask(&dir, &["bench", "probe", "--", "sh", "-c", "printf '| a |\\n| --- |\\n| 1 |\\n'; exit 3"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("keeps its previous run"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = xtask(&dir, &["bench", "probe", "--", "echo", "no table here"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("printed no Markdown table"), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_to_string(dir.join("probe.json")).unwrap(), "previous");
    let out = xtask(&dir, &["bench", "Bad/Name", "--", "true"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("lowercase letters, digits and dashes"));
    std::fs::remove_dir_all(dir).unwrap();
}
