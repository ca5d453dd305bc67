//! Handoff metrics, shared by the prefill and decode roles.

use prometheus::{Histogram, IntCounter, IntCounterVec, Registry};

use crate::metrics::RoleRegistry;

/// Every reason decode refuses an authenticated transfer for (the `reason` label of
/// `kvgate_handoff_mismatch_total`): evidence of missing, corrupt or forged KV.
pub const MISMATCH_REASONS: [&str; 9] =
    ["token_count", "checksum", "page_set", "auth", "fingerprint", "timeout", "unknown_handoff", "rejected_forwarded", "first_token"];
/// Why the KV port refused bytes nobody holding the secret sent, or a connection it would not
/// serve (`kvgate_kv_port_rejected_total{reason}`): abuse or noise, never an integrity event.
pub const KV_PORT_REASONS: [&str; 5] = ["malformed", "too_large", "unauthenticated", "read_timeout", "connection_limit"];
pub const OUTCOMES: [&str; 3] = ["committed", "rejected", "failed"];

#[derive(Clone)]
pub struct HandoffMetrics {
    pub total: IntCounterVec,
    pub mismatch: IntCounterVec,
    pub bytes: IntCounter,
    pub duration: Histogram,
    pub cancelled: IntCounter,
    pub expired: IntCounter,
    pub kv_port_rejected: IntCounterVec,
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
            expired: r.counter(
                "kvgate_handoff_reservations_expired_total",
                "Decode reservations freed unused: no frame ever arrived, or committed but never decoded.",
            ),
            kv_port_rejected: r.counter_vec(
                "kvgate_kv_port_rejected_total",
                "Frames or connections decode's KV port refused that no holder of the secret sent (malformed, oversized, unauthenticated, too slow, over the connection cap).",
                "reason",
                &KV_PORT_REASONS,
            ),
        }
    }
}
