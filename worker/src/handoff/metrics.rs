//! Handoff metrics, shared by the prefill and decode roles.

use kvgate_proto::refusal::{Mismatch, PortRefusal};
use prometheus::{Histogram, IntCounter, IntCounterVec, Registry};

use crate::metrics::RoleRegistry;
use crate::tenants::labels::{OTHER, TenantLabels};

pub const OUTCOMES: [&str; 3] = ["committed", "rejected", "failed"];

#[derive(Clone)]
pub struct HandoffMetrics {
    pub total: IntCounterVec,
    pub mismatch: IntCounterVec,
    /// The same refusals by the tenant whose request they hit (bounded labels).
    pub mismatch_by_tenant: IntCounterVec,
    tenant_labels: std::sync::Arc<TenantLabels>,
    pub bytes: IntCounter,
    pub duration: Histogram,
    pub size: Histogram,
    pub cancelled: IntCounter,
    pub expired: IntCounter,
    pub kv_port_rejected: IntCounterVec,
}

impl HandoffMetrics {
    /// Counts an integrity refusal, by reason and by the tenant whose request it hit.
    pub fn mismatched(&self, m: Mismatch, tenant: Option<&str>) {
        self.mismatch.with_label_values(&[m.as_str()]).inc();
        let label = self.tenant_labels.label(tenant.unwrap_or("unknown"));
        self.mismatch_by_tenant.with_label_values(&[label.as_str(), m.as_str()]).inc();
    }

    pub fn new(registry: &Registry, role: &str) -> Self {
        let r = RoleRegistry { registry, role };
        let mismatches = Mismatch::ALL.map(Mismatch::as_str);
        let port_refusals = PortRefusal::ALL.map(PortRefusal::as_str);
        HandoffMetrics {
            total: r.counter_vec("kvgate_handoff_total", "KV handoffs by outcome.", "outcome", &OUTCOMES),
            mismatch: r.counter_vec("kvgate_handoff_mismatch_total", "KV handoffs refused by decode's integrity checks, by reason.", "reason", &mismatches),
            mismatch_by_tenant: r.counter_grid(
                "kvgate_handoff_mismatch_by_tenant_total",
                "KV handoffs refused by integrity checks, by the tenant whose request they hit (the first 16 tenants by name, the rest `other`; `unknown` when no reservation names one) and reason.",
                ["tenant", "reason"],
                &[OTHER],
                &mismatches,
            ),
            tenant_labels: Default::default(),
            bytes: r.counter("kvgate_handoff_bytes_total", "KV page bytes moved over the handoff channel."),
            duration: r.histogram(
                "kvgate_handoff_duration_seconds",
                "Time from reservation to a verified commit (decode) or to decode's answer (prefill).",
                prometheus::exponential_buckets(0.0005, 2.0, 16).unwrap(),
            ),
            // 64 KiB to 16 GiB by fours: one page of a tiny model to a long prompt of a big one.
            size: r.histogram(
                "kvgate_handoff_size_bytes",
                "KV page bytes of one handoff: sent and acknowledged (prefill), verified and committed (decode).",
                prometheus::exponential_buckets(65536.0, 4.0, 10).unwrap(),
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
                &port_refusals,
            ),
        }
    }
}
