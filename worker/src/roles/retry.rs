//! When the router tries a request again: a peer failed before any byte of the answer reached
//! the client, so a fresh reservation on another prefill/decode pair (the same one when there
//! is no other) can still answer it whole. What is never tried again: anything after the first
//! token went out, a client error, a prompt too large, decode's refusal of an authenticated
//! transfer (an integrity verdict on a healthy path: counted, alerted, and answered 502), and a
//! deployment with no pair at all.

use std::sync::Arc;
use std::time::Duration;

use prometheus::IntCounterVec;
use strum::VariantArray;

use super::peers::Peer;
use crate::engine::Event;
use crate::metrics::RoleRegistry;

/// Attempts per request, the first included.
pub const ATTEMPTS: usize = 3;

/// Why a request was tried again (`reason` of `kvgate_router_retries_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr, strum::VariantArray)]
#[strum(serialize_all = "snake_case")]
pub enum Retry {
    /// Decode did not answer the reservation or the call to generate (refused, reset, gone).
    DecodeUnreachable,
    /// Prefill did not answer, or failed itself (its KV connection to decode broke, it died
    /// mid-transfer), so decode never received a whole handoff.
    PrefillFailed,
    /// Decode's stream ended before its first token.
    DecodeStreamBroke,
}

/// A failed attempt: the failure the client would see, and whether (and why) it may be tried
/// again, with the peers to avoid next time.
pub struct Failed {
    pub event: Event,
    pub retry: Option<(Retry, Vec<Arc<Peer>>)>,
}

impl Failed {
    pub fn last(event: Event) -> Self {
        Failed { event, retry: None }
    }

    pub fn retry(event: Event, why: Retry, avoid: &[&Arc<Peer>]) -> Self {
        Failed { event, retry: Some((why, avoid.iter().map(|p| Arc::clone(p)).collect())) }
    }
}

/// `kvgate_router_retries_total{reason}`.
#[derive(Clone)]
pub struct Retries(IntCounterVec);

impl Retries {
    pub fn new(registry: &prometheus::Registry, role: &str) -> Self {
        let reasons: Vec<&str> = Retry::VARIANTS.iter().map(|r| r.into()).collect();
        Retries(RoleRegistry { registry, role }.counter_vec(
            "kvgate_router_retries_total",
            "Requests the router sent to another prefill/decode pair because a peer failed before any byte reached the client, by reason.",
            "reason",
            &reasons,
        ))
    }

    pub fn count(&self, why: Retry) {
        let reason: &str = why.into();
        self.0.with_label_values(&[reason]).inc();
    }
}

/// The pause before attempt `n` (1-based for the first retry): long enough for a peer that
/// refused a burst to drain, short beside any answer's latency.
pub fn backoff(n: usize) -> Duration {
    Duration::from_millis(25 << n.min(4))
}
