//! `kvgate-worker probe`: the preflight that refuses a pool smaller than the window.

use std::process::Command;

fn probe(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvgate-worker")).arg("probe").args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn the_incident_pool_fails_the_probe_with_both_numbers() {
    let (ok, stdout, stderr) = probe(&["--context-window", "1048576", "--kv-pool-tokens", "681280", "--kv-dtype", "bf16"]);
    assert!(!ok, "a 681280-token pool must not pass a 1048576-token window");
    assert!(stdout.contains("681280 tokens"), "{stdout}");
    let last = stderr.lines().last().unwrap();
    assert!(last.contains("681280") && last.contains("1048576"), "{stderr}");
}

#[test]
fn a_pool_that_holds_the_window_passes_and_reports_json() {
    let (ok, stdout, stderr) = probe(&["--context-window", "4096", "--kv-pool-bytes", "4194304", "--json"]);
    assert!(ok, "{stderr}");
    let r: kvgate_proto::CapacityReport = serde_json::from_str(&stdout).unwrap();
    // 4 MiB / 512 bytes per token (tiny, f32) = 8192 tokens.
    assert_eq!(r.capacity_tokens, 8192);
    assert_eq!(r.num_pages, 512);
}

#[test]
fn a_memory_fraction_is_measured_from_available_memory() {
    let (ok, stdout, stderr) = probe(&["--context-window", "16", "--kv-memory-fraction", "0.001", "--json"]);
    assert!(ok, "{stderr}");
    let r: kvgate_proto::CapacityReport = serde_json::from_str(&stdout).unwrap();
    assert!(r.capacity_tokens >= 16 && r.capacity_tokens.is_multiple_of(16), "{r:?}");
    let (ok, _, stderr) = probe(&["--context-window", "16", "--kv-memory-fraction", "1.5"]);
    assert!(!ok && stderr.contains("--kv-memory-fraction"), "{stderr}");
}

#[test]
fn cuda_without_the_feature_is_a_clear_error() {
    if cfg!(feature = "cuda") {
        return;
    }
    let (ok, _, stderr) = probe(&["--context-window", "16", "--device", "cuda"]);
    assert!(!ok);
    assert!(stderr.contains("--features cuda"), "{stderr}");
}
