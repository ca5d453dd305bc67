//! Tenants: who a public request is from, proven (an API key, or a trusted gateway's header)
//! or, where the deployment authenticates nobody, its client's address, never an unverified
//! key. A tenant is the unit of in-flight caps, token quotas and per-tenant metrics.

pub mod identify;
pub mod keys;
pub mod labels;
pub mod metrics;
pub mod name;
pub mod quota;

use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

pub use identify::{Auth, TrustedProxy};
pub use keys::KeyRing;
pub use metrics::TenantMetrics;
pub use name::TenantName;
pub use quota::TokenQuota;

/// Who a public request is from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Tenant {
    /// Authenticated: its API key's tenant, or named by a trusted gateway.
    Named(TenantName),
    /// No authentication configured: the client's address.
    Addr(IpAddr),
    /// Neither (a caller without a listener, as unit tests are).
    Unknown,
}

impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tenant::Named(n) => write!(f, "{n}"),
            Tenant::Addr(a) => write!(f, "{a}"),
            Tenant::Unknown => f.write_str("unknown"),
        }
    }
}

impl Tenant {
    /// The tenant as the roles tell one another (a name and an address are both valid ids).
    pub fn id(&self) -> kvgate_proto::tenant_id::TenantId {
        kvgate_proto::tenant_id::TenantId::parse(&self.to_string()).expect("a tenant's name or address is a tenant id")
    }
}

/// Everything the public API knows about tenants.
#[derive(Debug)]
pub struct Tenants {
    pub auth: Auth,
    pub quota: TokenQuota,
    pub metrics: TenantMetrics,
}

impl Tenants {
    /// From the command line: reads the key directory once (an error stops the start) and
    /// parses the gateway's ranges and the quotas, naming the flag at fault.
    pub fn from_args(args: &crate::cli::TenantArgs, registry: &prometheus::Registry, role: &str) -> Result<Arc<Tenants>, String> {
        let Settings { proxy, quota } = Settings::parse(args)?;
        let keys = args.api_keys.as_deref().map(KeyRing::open).transpose()?;
        let known: Vec<String> = keys.as_ref().map(|k| k.current().names()).unwrap_or_default();
        let metrics = TenantMetrics::new(registry, role, &known);
        metrics.key_tenants.set(known.len() as i64);
        Ok(Arc::new(Tenants { auth: Auth { keys, proxy }, quota, metrics }))
    }
}

/// What the tenant flags say, checked without reading the key directory (which a pod mounts):
/// what `--check-config` checks.
pub struct Settings {
    pub proxy: Option<TrustedProxy>,
    pub quota: TokenQuota,
}

impl Settings {
    /// Parses the gateway's header and ranges and the quotas, naming the flag at fault.
    pub fn parse(args: &crate::cli::TenantArgs) -> Result<Settings, String> {
        let proxy = match &args.trusted_proxy_header {
            None => None,
            Some(h) => {
                let header = axum::http::HeaderName::from_bytes(h.as_bytes()).map_err(|_| format!("--trusted-proxy-header `{h}` is not a header name"))?;
                let from = args
                    .trusted_proxy_cidr
                    .iter()
                    .map(|c| c.parse::<ipnet::IpNet>().map_err(|_| format!("--trusted-proxy-cidr `{c}` is not a CIDR range (e.g. 10.0.0.0/8)")))
                    .collect::<Result<Vec<_>, _>>()?;
                Some(TrustedProxy { header, from })
            }
        };
        let mut per_tenant = std::collections::HashMap::new();
        for q in &args.tenant_quota {
            let (name, n) = q.split_once('=').ok_or_else(|| format!("--tenant-quota `{q}` is not NAME=TOKENS_PER_MINUTE"))?;
            let name = TenantName::parse(name).map_err(|e| format!("--tenant-quota `{q}`: {e}"))?;
            let n: u64 = n.parse().map_err(|_| format!("--tenant-quota `{q}`: `{n}` is not a number of tokens per minute"))?;
            per_tenant.insert(name, n);
        }
        let per_tenant = per_tenant.into_iter().filter(|(_, n)| *n > 0).collect();
        let default = (args.tenant_tokens_per_minute > 0).then_some(args.tenant_tokens_per_minute);
        Ok(Settings { proxy, quota: TokenQuota::new(default, per_tenant) })
    }
}

impl Tenants {
    /// Tokens generated for `tenant`: charged to its quota and counted.
    pub fn generated(&self, tenant: &Tenant, n: u64) {
        self.quota.charge(tenant, n);
        self.metrics.tokens(tenant, "generated", n);
    }

    /// Reads the key directory again every [`keys::RELOAD_EVERY`] (a no-op without keys).
    pub fn spawn_reload(self: &Arc<Self>) {
        let Some(ring) = self.auth.keys.clone() else { return };
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(keys::RELOAD_EVERY).await;
                match ring.reload() {
                    keys::Reload::Unchanged => {}
                    keys::Reload::Changed { tenants } => {
                        me.metrics.key_reloads.with_label_values(&["changed"]).inc();
                        me.metrics.key_tenants.set(tenants as i64);
                        me.metrics.name(&ring.current().names());
                        tracing::info!(tenants, dir = %ring.dir().display(), "API keys reloaded");
                    }
                    keys::Reload::Failed(why) => {
                        me.metrics.key_reloads.with_label_values(&["failed"]).inc();
                        tracing::warn!(error = %why, "API keys not reloaded; the last good keys stay in force");
                    }
                }
            }
        });
    }

    /// No authentication, no quota: tenants are client addresses (the router's default; unit
    /// tests).
    pub fn open(registry: &prometheus::Registry, role: &str) -> Arc<Tenants> {
        Arc::new(Tenants { auth: Auth::default(), quota: TokenQuota::default(), metrics: TenantMetrics::new(registry, role, &[]) })
    }
}
