//! When the router tries a request again: a peer failed before any byte of the answer reached
//! the client, so a fresh reservation on another prefill/decode pair (the same one when there
//! is no other) can still answer it whole. That includes decode's refusal of a transfer that
//! arrived too late (`timeout`): it says the transfer was slow, not that its KV was wrong, and
//! decode generated nothing from it (the refusal is still counted and alerted). What is never
//! tried again: anything after the first token went out, a client error, a prompt too large,
//! decode's every other refusal of an authenticated transfer (an integrity verdict: counted,
//! alerted, and answered 502), and a deployment with no pair at all.

use std::sync::Arc;
use std::time::Duration;

use prometheus::IntCounterVec;
use strum::VariantArray;

use kvgate_proto::refusal::{Mismatch, Refusal};

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
    /// Decode refused the transfer as late (`kv_handoff_timeout`): a sender starved of CPU or a
    /// path that hung past the reservation's deadline.
    HandoffTimeout,
}

/// Whether decode's refusal of a transfer, relayed by prefill, may be tried again: only a
/// timeout. Every other refusal is the integrity verdict, answered 502.
pub fn after_refusal(refusal: Refusal) -> Option<Retry> {
    (refusal == Refusal::Mismatch(Mismatch::Timeout)).then_some(Retry::HandoffTimeout)
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_proto::refusal::PortRefusal;

    #[test]
    fn only_a_late_transfer_is_tried_again_after_decodes_refusal() {
        for m in Mismatch::ALL {
            assert_eq!(after_refusal(Refusal::Mismatch(m)).is_some(), m == Mismatch::Timeout, "{m:?}");
        }
        for p in PortRefusal::ALL {
            assert_eq!(after_refusal(Refusal::Port(p)), None, "{p:?}");
        }
        assert_eq!(after_refusal(Refusal::Cancelled), None);
        assert_eq!(after_refusal(Refusal::Mismatch(Mismatch::Timeout)), Some(Retry::HandoffTimeout));
    }
}
