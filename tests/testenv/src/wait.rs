//! Waiting for a condition in a test, with what the world looked like when it did not happen.

use std::time::{Duration, Instant};

/// Polls `check` every `every` until it holds or `timeout` passes; panics with `what` and the
/// `diagnostics` (taken only on failure) when it never held.
pub fn eventually(what: &str, timeout: Duration, every: Duration, mut check: impl FnMut() -> bool, diagnostics: impl FnOnce() -> String) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check() {
            return;
        }
        std::thread::sleep(every);
    }
    panic!("{what} did not happen within {timeout:?}\n{}", diagnostics());
}
