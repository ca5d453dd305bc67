//! The contract between the operator and the worker: the roles a worker pod runs, the bounds
//! both enforce, and the names of the flags the operator renders and the worker parses.
//!
//! The CRD's schema, the operator's rendering and the worker's argument parser all read these
//! constants, and `operator/tests/contract.rs` runs the arguments rendered for specs at every
//! bound through the worker's own parser (`kvgate-worker --check-config`), so the API server
//! accepts no spec whose pods cannot start.

/// A worker pod's role: the subcommand it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KvRole {
    Prefill,
    Decode,
}

impl KvRole {
    pub const ALL: [KvRole; 2] = [KvRole::Prefill, KvRole::Decode];

    /// The subcommand, the `app.kubernetes.io/component` label and the metrics' `role` label.
    pub const fn as_str(self) -> &'static str {
        match self {
            KvRole::Prefill => "prefill",
            KvRole::Decode => "decode",
        }
    }

    /// The role whose pages this one exchanges.
    pub const fn peer(self) -> KvRole {
        match self {
            KvRole::Prefill => KvRole::Decode,
            KvRole::Decode => KvRole::Prefill,
        }
    }

    /// The HTTP port the role listens on in a pod.
    pub const fn port(self) -> u16 {
        match self {
            KvRole::Prefill => PREFILL_PORT,
            KvRole::Decode => DECODE_PORT,
        }
    }
}

pub const ROUTER_PORT: u16 = 8080;
pub const PREFILL_PORT: u16 = 8081;
pub const DECODE_PORT: u16 = 8082;
/// Decode's KV port (handoff frames).
pub const KV_PORT: u16 = 8083;

/// Tokens per KV page the worker supports: powers of two up to 1024.
pub const PAGE_SIZES: [u32; 11] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024];
/// The CRD's CEL rule on `kvPool.pageSize`, the same list as `PAGE_SIZES` (a test keeps them equal).
pub const PAGE_SIZE_RULE: &str = "self in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]";
pub const PAGE_SIZE_RULE_MESSAGE: &str = "pageSize must be a power of two from 1 to 1024";

pub fn page_size_supported(n: u64) -> bool {
    PAGE_SIZES.iter().any(|&p| p as u64 == n)
}

/// The flags the operator renders, as the worker's parser spells them.
pub mod flag {
    pub const LISTEN: &str = "listen";
    pub const KV_LISTEN: &str = "kv-listen";
    pub const KV_ADVERTISE: &str = "kv-advertise";
    pub const HANDOFF_TIMEOUT_MS: &str = "handoff-timeout-ms";
    pub const HANDOFF_SECRET_FILE: &str = "handoff-secret-file";
    pub const MODEL: &str = "model";
    pub const CONTEXT_WINDOW: &str = "context-window";
    pub const PAGE_SIZE: &str = "page-size";
    pub const KV_DTYPE: &str = "kv-dtype";
    pub const DEVICE: &str = "device";
    pub const KV_POOL_BYTES: &str = "kv-pool-bytes";
    pub const KV_POOL_TOKENS: &str = "kv-pool-tokens";
    pub const KV_MEMORY_FRACTION: &str = "kv-memory-fraction";
    pub const PREFILL_SERVICE: &str = "prefill-service";
    pub const DECODE_SERVICE: &str = "decode-service";
    pub const LOG_FORMAT: &str = "log-format";
    pub const API_KEYS: &str = "api-keys";
    pub const TRUSTED_PROXY_HEADER: &str = "trusted-proxy-header";
    pub const TRUSTED_PROXY_CIDR: &str = "trusted-proxy-cidr";
    pub const TENANT_TOKENS_PER_MINUTE: &str = "tenant-tokens-per-minute";
    pub const TENANT_QUOTA: &str = "tenant-quota";

    /// `--name=value`.
    pub fn arg(name: &str, value: impl std::fmt::Display) -> String {
        format!("--{name}={value}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_size_rule_lists_exactly_the_supported_sizes() {
        let listed: Vec<u32> = PAGE_SIZE_RULE.trim_start_matches("self in [").trim_end_matches(']').split(", ").map(|n| n.parse().unwrap()).collect();
        assert_eq!(listed, PAGE_SIZES);
        assert!(PAGE_SIZES.iter().all(|p| p.is_power_of_two()));
        assert!(PAGE_SIZE_RULE_MESSAGE.ends_with(&format!("to {}", PAGE_SIZES[PAGE_SIZES.len() - 1])));
        assert!(page_size_supported(1024) && !page_size_supported(2048) && !page_size_supported(0) && !page_size_supported(12));
    }
}
