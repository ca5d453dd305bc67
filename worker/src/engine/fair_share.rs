//! Compute fairness between tenants: the scheduler hands pages, prompt chunks and decode slots
//! to the tenant with work that has been served the fewest tokens, so one tenant's streams
//! back to back, or its long prompts sent and abandoned, take no more than its share while
//! another tenant waits. A tenant's count starts at the least-served working tenant's when it
//! starts working (an idle tenant banks no credit), and is forgotten when it has no work left,
//! so the table holds only tenants with work (start-time fair queueing over tokens).
//!
//! While more than one tenant has had work within [`RECENT`], the engine is *shared*: prompt
//! chunks are cut to a short step (`Pacer::shared_prompt_tokens`), so a tenant whose request
//! arrives while another's long prompt is being computed waits for one short chunk, not a long
//! one. A tenant alone gets whole chunks.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a tenant counts as sharing the engine after its last work.
pub const RECENT: Duration = Duration::from_secs(2);

#[derive(Debug, Default)]
pub struct FairShare {
    served: HashMap<Arc<str>, u64>,
    /// When each tenant last had work (kept for [`RECENT`]).
    seen: HashMap<Arc<str>, Instant>,
}

impl FairShare {
    /// What `tenant` has been served (the least-served working tenant's count if it is new):
    /// lower goes first.
    pub fn priority(&self, tenant: &str) -> u64 {
        self.served.get(tenant).copied().unwrap_or_else(|| self.floor())
    }

    fn floor(&self) -> u64 {
        self.served.values().copied().min().unwrap_or(0)
    }

    /// A tenant with new work: one that had none starts at the least-served working tenant's
    /// count as of now (and keeps that start while others are served past it).
    pub fn join(&mut self, tenant: &Arc<str>) {
        let floor = self.floor();
        self.served.entry(tenant.clone()).or_insert(floor);
        self.seen.insert(tenant.clone(), Instant::now());
    }

    /// Whether more than one tenant has had work within [`RECENT`] of `now`.
    pub fn shared(&self, now: Instant) -> bool {
        self.seen.values().filter(|t| now.saturating_duration_since(**t) < RECENT).nth(1).is_some()
    }

    /// `tokens` computed for `tenant`.
    pub fn charge(&mut self, tenant: &Arc<str>, tokens: u64) {
        let floor = self.floor();
        *self.served.entry(tenant.clone()).or_insert(floor) += tokens;
    }

    /// Forgets tenants without work (`working` lists those with some).
    pub fn keep_only<'a>(&mut self, working: impl IntoIterator<Item = &'a Arc<str>>) {
        let working: std::collections::HashSet<&str> = working.into_iter().map(|t| &**t).collect();
        self.served.retain(|t, _| working.contains(&**t));
        let now = Instant::now();
        for t in &working {
            if let Some(at) = self.seen.get_mut(*t) {
                *at = now;
            }
        }
        self.seen.retain(|_, at| now.saturating_duration_since(*at) < RECENT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_served_goes_first_and_idle_tenants_bank_nothing() {
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        let mut f = FairShare::default();
        f.charge(&a, 1000);
        assert!(f.priority("b") <= f.priority("a"), "a newcomer starts at the least served");
        let c: Arc<str> = "c".into();
        f.join(&c);
        f.charge(&a, 500);
        assert_eq!(f.priority("c"), 1000, "joined when a was at 1000, c keeps that start while a is served");
        f.keep_only([&a]);
        f.charge(&b, 10);
        assert_eq!((f.priority("a"), f.priority("b")), (1500, 1510), "b joined at a's count; now a goes first");
        f.keep_only([&a]);
        assert_eq!(f.priority("b"), 1500, "b left; coming back it starts at a's count, not at 10");
        f.keep_only([]);
        assert_eq!(f.priority("a"), 0);
    }

    #[test]
    fn the_engine_is_shared_while_two_tenants_had_work_recently() {
        let mut f = FairShare::default();
        let now = Instant::now();
        f.join(&"a".into());
        assert!(!f.shared(now), "one tenant alone");
        f.join(&"b".into());
        assert!(f.shared(Instant::now()));
        f.keep_only([]);
        assert!(f.shared(Instant::now()), "both had work a moment ago");
        assert!(!f.shared(Instant::now() + RECENT), "and no longer after RECENT");
    }
}
