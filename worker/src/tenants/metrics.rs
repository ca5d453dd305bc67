//! Per-tenant metrics with bounded cardinality (`labels`): the first tenants (those with API
//! keys first, in name order) have their own `tenant` label, every later one is `other`, and a
//! request with no tenant is `unauthenticated`.

use prometheus::{IntCounterVec, IntGauge, Opts, Registry};

use super::Tenant;
use super::labels::{OTHER, TenantLabels};

pub const UNAUTHENTICATED: &str = "unauthenticated";
/// Why a tenant's request was turned away before it was served.
pub const REFUSALS: [&str; 3] = ["unauthenticated", "in_flight", "token_quota"];

#[derive(Debug)]
pub struct TenantMetrics {
    labels: TenantLabels,
    requests: IntCounterVec,
    tokens: IntCounterVec,
    refusals: IntCounterVec,
    pub key_tenants: IntGauge,
    pub key_reloads: IntCounterVec,
}

impl TenantMetrics {
    /// Registers the families; `known` tenants (API key files) take their labels first.
    pub fn new(registry: &Registry, role: &str, known: &[String]) -> TenantMetrics {
        let opts = |name: &str, help: &str| Opts::new(name, help).const_label("role", role);
        let vec = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(opts(name, help), labels).unwrap();
            registry.register(Box::new(c.clone())).unwrap();
            c
        };
        let m = TenantMetrics {
            labels: TenantLabels::default(),
            requests: vec("kvgate_tenant_requests_total", "Public API requests answered, by tenant and HTTP status code.", &["tenant", "code"]),
            tokens: vec("kvgate_tenant_tokens_total", "Tokens by tenant: `prompt` of admitted requests, `generated`.", &["tenant", "kind"]),
            refusals: vec(
                "kvgate_tenant_refusals_total",
                "Requests turned away before they were served, by tenant and reason (unauthenticated, in_flight, token_quota).",
                &["tenant", "reason"],
            ),
            key_tenants: IntGauge::with_opts(opts("kvgate_api_key_tenants", "Tenants with at least one API key in force (0 when keys are off).")).unwrap(),
            key_reloads: vec(
                "kvgate_api_key_reloads_total",
                "Readings of the API key directory that changed the keys, or failed (the last good keys stay).",
                &["result"],
            ),
        };
        registry.register(Box::new(m.key_tenants.clone())).unwrap();
        for result in ["changed", "failed"] {
            m.key_reloads.with_label_values(&[result]);
        }
        // Every family from the first scrape: the label values that always exist at 0.
        m.refusals.with_label_values(&[UNAUTHENTICATED, "unauthenticated"]);
        m.requests.with_label_values(&[UNAUTHENTICATED, "401"]);
        for kind in ["prompt", "generated"] {
            m.tokens.with_label_values(&[OTHER, kind]);
        }
        m.name(known);
        m
    }

    /// Gives `tenants` their labels first (while any are left).
    pub fn name(&self, tenants: &[String]) {
        let mut sorted = tenants.to_vec();
        sorted.sort();
        for t in sorted {
            let label = self.label_of(&t);
            for reason in &REFUSALS[1..] {
                self.refusals.with_label_values(&[label.as_str(), reason]);
            }
            for kind in ["prompt", "generated"] {
                self.tokens.with_label_values(&[label.as_str(), kind]);
            }
        }
    }

    fn label_of(&self, tenant: &str) -> String {
        self.labels.label(tenant)
    }

    /// The `tenant` label `tenant` is counted under.
    pub fn label(&self, tenant: &Tenant) -> String {
        self.label_of(&tenant.to_string())
    }

    pub fn answered(&self, tenant: &Tenant, code: u16) {
        self.requests.with_label_values(&[&self.label(tenant), &code.to_string()]).inc();
    }

    /// A refusal; `None` for a request with no tenant.
    pub fn refused(&self, tenant: Option<&Tenant>, reason: &str) {
        let label = tenant.map_or_else(|| UNAUTHENTICATED.to_string(), |t| self.label(t));
        self.refusals.with_label_values(&[&label, reason]).inc();
    }

    pub fn tokens(&self, tenant: &Tenant, kind: &str, n: u64) {
        self.tokens.with_label_values(&[&self.label(tenant), kind]).inc_by(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenants::TenantName;

    #[test]
    fn labels_are_bounded_and_known_tenants_come_first() {
        let known: Vec<String> = vec!["zeta".into(), "acme".into()];
        let m = TenantMetrics::new(&Registry::new(), "router", &known);
        for i in 0..40 {
            m.answered(&Tenant::Named(TenantName::parse(&format!("t{i:02}")).unwrap()), 200);
        }
        assert_eq!(m.label(&Tenant::Named(TenantName::parse("zeta").unwrap())), "zeta");
        assert_eq!(m.label(&Tenant::Named(TenantName::parse("t13").unwrap())), "t13");
        assert_eq!(m.label(&Tenant::Named(TenantName::parse("t14").unwrap())), OTHER, "2 known + 14 seen = 16 labels");
        assert_eq!(m.labels.len(), super::super::labels::MAX_NAMED);
    }
}
