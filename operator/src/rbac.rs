//! Every API permission the operator uses, next to the code that uses it. The Helm chart's
//! ClusterRole and Role grant exactly these (a test compares them), so a permission added here
//! without the chart, or to the chart without a use here, fails the tests.

/// (API group, resource, verbs) granted across the namespaces the operator watches.
pub const WATCHED_NAMESPACES: &[(&str, &str, &[&str])] = &[
    // run.rs watches them (the controller's store) and applies status.
    ("kvgate.dev", "inferencedeployments", &["list", "watch"]),
    ("kvgate.dev", "inferencedeployments/status", &["patch"]),
    // Owned objects: server-side apply (create + patch) of what differs from the watch-fed
    // stores (list + watch, `watch/`); old revisions' Deployments deleted.
    ("apps", "deployments", &["create", "delete", "list", "patch", "watch"]),
    ("", "services", &["create", "list", "patch", "watch"]),
    ("", "serviceaccounts", &["create", "list", "patch", "watch"]),
    ("rbac.authorization.k8s.io", "roles", &["create", "list", "patch", "watch"]),
    ("rbac.authorization.k8s.io", "rolebindings", &["create", "list", "patch", "watch"]),
    // The optional gateway InferencePool (`reconcile::inference_pool`): watched once a
    // deployment asks for one (`watch::inference_pools`), read with a GET while the watch has
    // not listed (its CRD may be missing), server-side applied like the owned objects above (an
    // apply that creates needs `create` as well as `patch`: without it the chart's test sees no
    // pool), deleted when no longer asked.
    ("inference.networking.k8s.io", "inferencepools", &["create", "delete", "get", "list", "patch", "watch"]),
    // The router's Role grants these; RBAC lets the operator grant only what it holds itself.
    ("discovery.k8s.io", "endpointslices", &["get", "list", "watch"]),
    // The handoff Secret: created once per deployment, its bytes derived from the root key
    // (`keys`). Never read, listed, watched or overwritten: create alone cannot see or change
    // anyone's Secret.
    ("", "secrets", &["create"]),
    // kvgate's vLLM connector (`render::vllm_connector`): a ConfigMap per deployment and
    // digest, immutable, in a store like the objects above (applied again if someone deletes
    // it).
    ("", "configmaps", &["create", "list", "patch", "watch"]),
    // The rollout gate: pods watched (their store), their readiness-gate condition patched.
    ("", "pods", &["list", "watch"]),
    ("", "pods/status", &["patch"]),
    // Events (events.k8s.io/v1: created, then patched as a series).
    ("events.k8s.io", "events", &["create", "patch"]),
];

/// Granted only in the operator's own namespace: the leader-election Lease, and the root key
/// Secret created on first start (`keys::load_or_create`).
pub const OWN_NAMESPACE: &[(&str, &str, &[&str])] = &[("coordination.k8s.io", "leases", &["create", "get", "update"]), ("", "secrets", &["create"])];

/// Granted in the operator's own namespace for the root key Secret only (`resourceNames`): the
/// one Secret the operator ever reads.
pub const ROOT_KEY: (&str, &str, &[&str]) = ("", "secrets", &["get"]);
