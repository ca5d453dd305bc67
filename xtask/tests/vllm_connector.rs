//! The vLLM connector's own tests (engines/vllm/tests: the block digest, decode's verdict for
//! every reason, blocks a real vLLM prefill sealed) with target/pyenv's Python and numpy, so CI
//! checks the arithmetic and the verdicts without vLLM; the connector inside real vLLM pairs
//! runs under `make test-vllm`.

use std::path::Path;
use std::process::Command;

#[test]
fn the_vllm_connectors_digest_and_verdicts_pass_their_tests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let python = root.join("target/pyenv/bin/python");
    assert!(python.exists(), "{} is missing: run `make test-deps` (scripts/py-deps.sh installs it)", python.display());
    let out = Command::new(&python)
        .args(["-m", "unittest", "discover", "-v", "-s", "tests", "-t", "."])
        .current_dir(root.join("engines/vllm"))
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", python.display()));
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "engines/vllm's tests failed:\n{log}");
    let ran: usize = log.lines().find_map(|l| l.strip_prefix("Ran ")?.split(' ').next()?.parse().ok()).unwrap_or(0);
    assert!(ran >= 16, "engines/vllm ran {ran} tests, fewer than the 16 it has (a file not discovered?):\n{log}");
    assert!(!log.contains("skipped"), "engines/vllm skipped tests:\n{log}");
}
