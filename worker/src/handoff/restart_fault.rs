//! A test-only fault of the whole process (compiled into `testing` builds only), for the
//! operator's re-verification of serving pods:
//! with `KVGATE_FAULT_RESTART_SMALLER_AFTER=N` (and `KVGATE_ALLOW_FAULT_INJECTION=true`, in a
//! build with the `testing` feature) a prefill worker exits after its Nth handoff, and when the
//! pod restarts it, allocates an eighth of its pool. A marker in `/tmp` (an emptyDir, which
//! outlives the container) tells the restart from the first start.

use std::path::Path;

const AFTER: &str = "KVGATE_FAULT_RESTART_SMALLER_AFTER";
const MARKER: &str = "/tmp/kvgate-fault-started-once";

/// The handoff count after which the process exits, when the fault is on (read from the
/// environment once: `handoff_done` runs on every prefill).
pub fn after() -> Option<u64> {
    static AFTER_N: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *AFTER_N.get_or_init(|| {
        let allowed = std::env::var(super::faults::ALLOW).is_ok_and(|v| v == "true");
        allowed.then(|| std::env::var(AFTER).ok()?.parse().ok()).flatten()
    })
}

/// The pages to allocate: all of them on the first start, an eighth after a restart.
pub fn pages(pages: usize) -> usize {
    if after().is_none() {
        return pages;
    }
    if Path::new(MARKER).exists() {
        tracing::warn!(pages, shrunk = pages / 8, "FAULT INJECTION: restarted, allocating an eighth of the KV pool");
        return pages / 8;
    }
    if let Err(e) = std::fs::write(MARKER, b"") {
        tracing::warn!(error = %e, path = MARKER, "FAULT INJECTION: cannot write the restart marker");
    }
    pages
}

/// Called after handoff number `n` completed: exits the process at the configured count.
pub fn handoff_done(n: u64) {
    if after().is_some_and(|after| n >= after) {
        tracing::error!(n, "FAULT INJECTION: exiting after {n} handoffs, to come back with a smaller pool");
        std::process::exit(1);
    }
}
