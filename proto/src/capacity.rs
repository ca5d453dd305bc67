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
    fn json_round_trip_keeps_every_field() {
        let r = report();
        let text = serde_json::to_string(&r).unwrap();
        assert!(text.contains("\"capacity_tokens\":681280"));
        let back: CapacityReport = serde_json::from_str(&text).unwrap();
        assert_eq!(back, r);
    }
}
