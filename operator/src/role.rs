//! The roles of a deployment's pods, as labels, metrics and the gate name them.

/// A role of a deployment's pods: prefill and decode (kvgate's workers, or a disaggregated
/// engine's servers), an external engine's single server, or a router.
///
/// The gate reads the KV capacity of every prefill, decode and server pod. A router holds no KV:
/// kvgate's runs outside the revisions and is not gated; a disaggregated engine's router is part
/// of its revision and passes the gate once every pod it routes to has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    Prefill,
    Decode,
    Server,
    Router,
}

impl Role {
    /// The `app.kubernetes.io/component` label and the metrics' `role` label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Server => "server",
            Role::Router => "router",
        }
    }

    /// Whether its pods hold KV (and are read for their capacity).
    pub const fn holds_kv(self) -> bool {
        !matches!(self, Role::Router)
    }

    /// The kvgate worker role (its subcommand and port), for prefill and decode.
    pub const fn worker(self) -> Option<kvgate_proto::contract::KvRole> {
        match self {
            Role::Prefill => Some(kvgate_proto::contract::KvRole::Prefill),
            Role::Decode => Some(kvgate_proto::contract::KvRole::Decode),
            Role::Server | Role::Router => None,
        }
    }

    /// The role whose pages this one exchanges (and whose fingerprints must agree).
    pub const fn peer(self) -> Option<Role> {
        match self {
            Role::Prefill => Some(Role::Decode),
            Role::Decode => Some(Role::Prefill),
            Role::Server | Role::Router => None,
        }
    }

    /// The role a pod's component label names.
    pub fn from_component(label: &str) -> Option<Role> {
        [Role::Prefill, Role::Decode, Role::Server, Role::Router].into_iter().find(|r| r.as_str() == label)
    }
}
