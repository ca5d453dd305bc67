//! Handoff metrics, shared by the prefill and decode roles.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts, Registry};

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
        let opts = |n: &str, h: &str| Opts::new(n, h).const_label("role", role);
        let vec = |n: &str, h: &str, label: &str, values: &[&str]| {
            let c = IntCounterVec::new(opts(n, h), &[label]).unwrap();
            values.iter().for_each(|v| {
                c.with_label_values(&[*v]);
            });
            registry.register(Box::new(c.clone())).unwrap();
            c
        };
        let counter = |n: &str, h: &str| {
            let c = IntCounter::with_opts(opts(n, h)).unwrap();
            registry.register(Box::new(c.clone())).unwrap();
            c
        };
        let duration = Histogram::with_opts(
            HistogramOpts::new("kvgate_handoff_duration_seconds", "Time from reservation to a verified commit (decode) or to decode's answer (prefill).")
                .const_label("role", role)
                .buckets(prometheus::exponential_buckets(0.0005, 2.0, 16).unwrap()),
        )
        .unwrap();
        registry.register(Box::new(duration.clone())).unwrap();
        HandoffMetrics {
            total: vec("kvgate_handoff_total", "KV handoffs by outcome.", "outcome", &OUTCOMES),
            mismatch: vec("kvgate_handoff_mismatch_total", "KV handoffs refused by decode's integrity checks, by reason.", "reason", &MISMATCH_REASONS),
            bytes: counter("kvgate_handoff_bytes_total", "KV page bytes moved over the handoff channel."),
            duration,
            cancelled: counter("kvgate_handoff_reservations_cancelled_total", "Decode reservations cancelled before a commit (a rejection elsewhere)."),
            expired: counter("kvgate_handoff_reservations_expired_total", "Decode reservations that expired without a commit."),
        }
    }
}
