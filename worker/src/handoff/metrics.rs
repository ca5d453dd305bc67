//! Handoff metrics, shared by the prefill and decode roles.

use prometheus::{Histogram, IntCounter, IntCounterVec, Registry};

use crate::metrics::RoleRegistry;

/// Every reason decode refuses a transfer for (the `reason` label).
pub const MISMATCH_REASONS: [&str; 8] =
    ["token_count", "checksum", "page_set", "auth", "fingerprint", "timeout", "unknown_handoff", "rejected_forwarded"];
pub const OUTCOMES: [&str; 3] = ["committed", "rejected", "failed"];

#[derive(Clone)]
pub struct HandoffMetrics {
    pub total: IntCounterVec,
    pub mismatch: IntCounterVec,
    pub bytes: IntCounter,
    pub duration: Histogram,
    pub cancelled: IntCounter,
    pub expired: IntCounter,
}

impl HandoffMetrics {
    pub fn new(registry: &Registry, role: &str) -> Self {
        let r = RoleRegistry { registry, role };
        HandoffMetrics {
            total: r.counter_vec("kvgate_handoff_total", "KV handoffs by outcome.", "outcome", &OUTCOMES),
            mismatch: r.counter_vec("kvgate_handoff_mismatch_total", "KV handoffs refused by decode's integrity checks, by reason.", "reason", &MISMATCH_REASONS),
            bytes: r.counter("kvgate_handoff_bytes_total", "KV page bytes moved over the handoff channel."),
            duration: r.histogram(
                "kvgate_handoff_duration_seconds",
                "Time from reservation to a verified commit (decode) or to decode's answer (prefill).",
                prometheus::exponential_buckets(0.0005, 2.0, 16).unwrap(),
            ),
            cancelled: r.counter("kvgate_handoff_reservations_cancelled_total", "Decode reservations cancelled before a commit (a rejection elsewhere)."),
            expired: r.counter("kvgate_handoff_reservations_expired_total", "Decode reservations that expired without a commit."),
        }
    }
}
