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
fn an_8_bit_pool_holds_nearly_twice_the_tokens_of_f16_in_the_same_bytes() {
    let report = |dtype: &str| {
        let (ok, stdout, stderr) = probe(&["--context-window", "4096", "--kv-pool-bytes", "4194304", "--kv-dtype", dtype, "--json"]);
        assert!(ok, "{dtype}: {stderr}");
        serde_json::from_str::<kvgate_proto::CapacityReport>(&stdout).unwrap()
    };
    let (f16, q8) = (report("f16"), report("q8_0"));
    // tiny: 2 layers x K/V x one 32-value block (2 kv heads x 16 dims) of 34 bytes.
    assert_eq!(q8.bytes_per_token, 2 * 2 * 34);
    assert_eq!((f16.capacity_tokens, q8.capacity_tokens), (16384, 30832), "4 MiB in whole 16-token pages");
    assert_eq!(q8.dtype, "q8_0");
    assert_ne!(q8.layout_fingerprint, f16.layout_fingerprint, "8-bit pages must never pair with f16 pages");
}

#[test]
fn an_unknown_kv_dtype_is_refused_naming_the_ones_served() {
    let (ok, _, stderr) = probe(&["--context-window", "16", "--kv-dtype", "q4_0"]);
    assert!(!ok && stderr.contains("q4_0") && stderr.contains("f32, f16, bf16 or q8_0"), "{stderr}");
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
