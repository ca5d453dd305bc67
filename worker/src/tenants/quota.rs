//! Token quotas: prompt plus generated tokens per minute, per tenant, as a token bucket that
//! holds at most one minute's worth. A request is admitted while its tenant's bucket holds its
//! prompt; generated tokens are charged as they are produced (a bucket may go below zero, and
//! the tenant then waits for it to refill). Tenants without a quota are not metered.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{Tenant, TenantName};

/// Buckets kept before full ones (tenants back at their whole quota) are forgotten.
const MAX_BUCKETS: usize = 4096;

#[derive(Debug, Default)]
pub struct TokenQuota {
    /// Tokens per minute of every tenant not named in `per_tenant` (None: unmetered).
    pub default: Option<u64>,
    pub per_tenant: HashMap<TenantName, u64>,
    buckets: Mutex<HashMap<Tenant, Bucket>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    level: f64,
    at: Instant,
}

/// A request its tenant's quota cannot take now.
#[derive(Debug, Clone, PartialEq)]
pub struct OverQuota {
    pub tenant: String,
    pub per_minute: u64,
    pub needed: u64,
    /// When the bucket will hold `needed` (None: never, the request is larger than a minute's
    /// quota).
    pub retry_after: Option<Duration>,
}

impl OverQuota {
    /// What the client is told (code `tenant_token_quota`).
    pub fn message(&self) -> String {
        match self.retry_after {
            Some(after) => format!(
                "Tenant `{}` is over its token quota of {} tokens per minute (prompt + generated); this request's prompt needs {} tokens, available in {:.1} s.",
                self.tenant,
                self.per_minute,
                self.needed,
                after.as_secs_f64()
            ),
            None => format!(
                "This request's prompt of {} tokens is larger than tenant `{}`'s whole token quota of {} tokens per minute.",
                self.needed, self.tenant, self.per_minute
            ),
        }
    }
}

impl TokenQuota {
    pub fn new(default: Option<u64>, per_tenant: HashMap<TenantName, u64>) -> TokenQuota {
        TokenQuota { default, per_tenant, buckets: Mutex::new(HashMap::new()) }
    }

    /// The tenant's tokens per minute, if it is metered.
    pub fn per_minute(&self, tenant: &Tenant) -> Option<u64> {
        match tenant {
            Tenant::Named(n) => self.per_tenant.get(n).copied().or(self.default),
            _ => self.default,
        }
    }

    /// Takes `prompt` tokens from the tenant's bucket, or says when it could.
    pub fn admit(&self, tenant: &Tenant, prompt: u64) -> Result<(), OverQuota> {
        self.admit_at(tenant, prompt, Instant::now())
    }

    fn admit_at(&self, tenant: &Tenant, prompt: u64, now: Instant) -> Result<(), OverQuota> {
        let Some(per_minute) = self.per_minute(tenant) else { return Ok(()) };
        let over = |retry_after| OverQuota { tenant: tenant.to_string(), per_minute, needed: prompt, retry_after };
        if prompt > per_minute {
            return Err(over(None));
        }
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if buckets.len() >= MAX_BUCKETS {
            buckets.retain(|t, b| b.level_at(now, self.per_minute(t).unwrap_or(0)) < self.per_minute(t).unwrap_or(0) as f64);
        }
        let bucket = buckets.entry(tenant.clone()).or_insert(Bucket { level: per_minute as f64, at: now });
        bucket.level = bucket.level_at(now, per_minute);
        bucket.at = now;
        if bucket.level < prompt as f64 {
            let per_second = per_minute as f64 / 60.0;
            return Err(over(Some(Duration::from_secs_f64((prompt as f64 - bucket.level) / per_second))));
        }
        bucket.level -= prompt as f64;
        Ok(())
    }

    /// Charges tokens already produced (generated ones) to a metered tenant.
    pub fn charge(&self, tenant: &Tenant, tokens: u64) {
        let Some(per_minute) = self.per_minute(tenant) else { return };
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let bucket = buckets.entry(tenant.clone()).or_insert(Bucket { level: per_minute as f64, at: now });
        bucket.level = bucket.level_at(now, per_minute) - tokens as f64;
        bucket.at = now;
    }
}

impl Bucket {
    fn level_at(&self, now: Instant, per_minute: u64) -> f64 {
        let refill = now.saturating_duration_since(self.at).as_secs_f64() * per_minute as f64 / 60.0;
        (self.level + refill).min(per_minute as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(n: &str) -> Tenant {
        Tenant::Named(TenantName::parse(n).unwrap())
    }

    #[test]
    fn a_tenant_at_its_quota_waits_while_others_are_unaffected() {
        let q = TokenQuota::new(Some(6000), HashMap::from([(TenantName::parse("small").unwrap(), 600)]));
        let t0 = Instant::now();
        assert!(q.admit_at(&named("small"), 500, t0).is_ok());
        q.charge(&named("small"), 50);
        let over = q.admit_at(&named("small"), 100, t0).unwrap_err();
        assert_eq!((over.tenant.as_str(), over.per_minute, over.needed), ("small", 600, 100));
        // 50 left, 50 more needed at 10 tokens a second: about 5 s.
        assert!((over.retry_after.unwrap().as_secs_f64() - 5.0).abs() < 0.1, "{over:?}");
        assert!(q.admit_at(&named("big"), 5000, t0).is_ok(), "another tenant has its own bucket");
        assert!(q.admit_at(&named("small"), 100, t0 + Duration::from_secs(6)).is_ok(), "the bucket refills");
        let never = q.admit_at(&named("small"), 601, t0).unwrap_err();
        assert_eq!(never.retry_after, None);
        assert!(never.message().contains("larger than tenant `small`'s whole token quota of 600"));
    }

    #[test]
    fn unmetered_tenants_are_never_refused() {
        let q = TokenQuota::default();
        assert!(q.admit(&named("a"), u64::MAX).is_ok());
        q.charge(&named("a"), 1 << 40);
        assert!(q.buckets.lock().unwrap().is_empty());
    }
}
