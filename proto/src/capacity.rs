//! The capacity report: what a worker's KV pool *really* holds, measured after allocation.

use serde::{Deserialize, Serialize};

/// HTTP path on which every worker serves its [`CapacityReport`].
pub const KV_POOL_PATH: &str = "/v1/kv-pool";

/// A worker's measured KV pool.
///
/// `capacity_tokens` is what was actually allocated (whole pages), never what was asked for; the
/// operator's rollout gate compares it with the declared context window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapacityReport {
    /// Tokens the pool holds: `num_pages * page_size`.
    pub capacity_tokens: u64,
    /// Tokens per page.
    pub page_size: u32,
    /// Pages allocated.
    pub num_pages: u64,
    /// KV bytes one token occupies across all layers (K and V).
    pub bytes_per_token: u64,
    /// Where the pool lives: `cpu` or `cuda:N`.
    pub device: String,
    /// Element type of the stored K/V: `f32`, `f16` or `bf16`.
    pub dtype: String,
    /// Name of the served model.
    pub model: String,
    /// Hash of the model's config and weights; prefill and decode must agree on it.
    pub model_fingerprint: String,
    /// Hash of the KV layout (layers, heads, head size, page size, dtype); must agree too.
    pub layout_fingerprint: String,
    /// Tokens in the model's vocabulary (the operator's canary prompts stay below it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab_size: Option<u32>,
    /// The worker process ([`crate::auth::Instance`], random at each start): signed calls to its
    /// internal endpoints name it, so they are good at this process only.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub instance: String,
    /// How fast this worker prefilled prompts at start (prefill role), so that the operator can
    /// tell whether a prompt of the whole window can be prefilled before the handoff deadline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_timings: Option<PrefillTimings>,
}

/// Two prompts a prefill worker computed at start, `tokens[0]` and twice as many, and how long
/// each took (microseconds). Prefill costs `a n + b n^2` (the weights' work, then attention over what came
/// before): the two points fix `a` and `b`, which extrapolate to longer prompts (an estimate,
/// from short prompts: caches and memory bandwidth change at length).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillTimings {
    pub tokens: [u64; 2],
    pub micros: [u64; 2],
}

impl PrefillTimings {
    /// `(a, b)` of `a n + b n^2` in milliseconds, neither negative (noise can make the measured
    /// growth look sub-linear).
    fn fit(&self) -> (f64, f64) {
        let ([n1, n2], [t1, t2]) = (self.tokens.map(|n| n as f64), self.micros.map(|us| us as f64 / 1000.0));
        let b = ((t2 / n2 - t1 / n1) / (n2 - n1)).max(0.0);
        let a = (t2 / n2 - b * n2).max(0.0);
        (a, b)
    }

    /// Estimated milliseconds to prefill a prompt of `n` tokens.
    pub fn estimate_ms(&self, n: u64) -> f64 {
        let (a, b) = self.fit();
        let n = n as f64;
        a * n + b * n * n
    }

    /// The longest prompt whose estimate is within `ms`.
    pub fn tokens_within(&self, ms: f64) -> u64 {
        let (a, b) = self.fit();
        let n = if b > 0.0 {
            (-a + (a * a + 4.0 * b * ms).sqrt()) / (2.0 * b)
        } else if a > 0.0 {
            ms / a
        } else {
            f64::MAX
        };
        n.min(u64::MAX as f64) as u64
    }
}

/// What a router serves on [`KV_POOL_PATH`] (a public port): the capacity each peer last
/// reported, without the peers' internal addresses or instances (`report` is absent for a peer
/// that has not answered).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerReports {
    pub prefill: Vec<PeerReport>,
    pub decode: Vec<PeerReport>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerReport {
    /// Whether the peer answered its last capacity read.
    pub reachable: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<CapacityReport>,
}

impl CapacityReport {
    /// Bytes the pool occupies.
    pub fn pool_bytes(&self) -> u64 {
        self.capacity_tokens * self.bytes_per_token
    }

    /// True when the pool can hold a whole sequence of `tokens` tokens.
    pub fn holds(&self, tokens: u64) -> bool {
        self.capacity_tokens >= tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> CapacityReport {
        CapacityReport {
            capacity_tokens: 681_280,
            page_size: 16,
            num_pages: 42_580,
            bytes_per_token: 256,
            device: "cpu".into(),
            dtype: "bf16".into(),
            model: "tiny".into(),
            model_fingerprint: "m".into(),
            layout_fingerprint: "l".into(),
            vocab_size: Some(258),
            instance: "0123456789abcdef0123456789abcdef".into(),
            prefill_timings: Some(PrefillTimings { tokens: [512, 1024], micros: [100_000, 240_000] }),
        }
    }

    #[test]
    fn the_incident_pool_does_not_hold_the_declared_window() {
        let r = report();
        assert!(!r.holds(1_048_576));
        assert!(r.holds(681_280));
        assert_eq!(r.pool_bytes(), 681_280 * 256);
    }

    #[test]
    fn prefill_timings_fit_linear_and_quadratic_growth_and_invert() {
        // 0.1 ms a token plus 1e-4 ms a token squared, measured exactly.
        let t = |n: f64| 0.1 * n + 1e-4 * n * n;
        let p = PrefillTimings { tokens: [1000, 2000], micros: [(t(1000.0) * 1000.0) as u64, (t(2000.0) * 1000.0) as u64] };
        for n in [1000u64, 100_000, 1_048_576] {
            let (got, want) = (p.estimate_ms(n), t(n as f64));
            assert!((got - want).abs() / want < 1e-9, "{n}: {got} vs {want}");
        }
        let n = p.tokens_within(30_000.0);
        assert!(t(n as f64) <= 30_000.0 && t(n as f64 + 2.0) > 30_000.0, "{n}");
        // Growth below linear (noise) counts as linear, never as a negative cost.
        let noisy = PrefillTimings { tokens: [1000, 2000], micros: [150_000, 200_000] };
        assert_eq!(noisy.estimate_ms(4000), 400.0);
        assert_eq!(noisy.tokens_within(400.0), 4000);
    }

    #[test]
    fn json_round_trip_keeps_every_field() {
        let r = report();
        let text = serde_json::to_string(&r).unwrap();
        assert!(text.contains("\"capacity_tokens\":681280"));
        let back: CapacityReport = serde_json::from_str(&text).unwrap();
        assert_eq!(back, r);
    }
}
