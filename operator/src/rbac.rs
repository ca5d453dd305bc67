//! Every API permission the operator uses, next to the code that uses it. The Helm chart's
//! ClusterRole and Role grant exactly these (a test compares them), so a permission added here
//! without the chart, or to the chart without a use here, fails the tests.

/// (API group, resource, verbs) granted across the namespaces the operator watches.
pub const WATCHED_NAMESPACES: &[(&str, &str, &[&str])] = &[
    // run.rs watches them; rollout.rs reads the current object and applies status.
    ("kvgate.dev", "inferencedeployments", &["get", "list", "watch"]),
    ("kvgate.dev", "inferencedeployments/status", &["patch"]),
    // Owned workloads: server-side apply (create + patch), the owns() watch, old revisions deleted.
    ("apps", "deployments", &["create", "delete", "list", "patch", "watch"]),
    ("", "services", &["create", "patch"]),
    ("", "serviceaccounts", &["create", "patch"]),
    ("rbac.authorization.k8s.io", "roles", &["create", "patch"]),
    ("rbac.authorization.k8s.io", "rolebindings", &["create", "patch"]),
    // The router's Role grants these; RBAC lets the operator grant only what it holds itself.
    ("discovery.k8s.io", "endpointslices", &["get", "list", "watch"]),
    // The handoff Secret: generated once (create); read by name (get) to verify the workers'
    // signed capacity reports and to sign the canary's calls. Never listed or watched.
    ("", "secrets", &["create", "get"]),
    // The rollout gate: pods listed and watched, their readiness-gate condition patched.
    ("", "pods", &["list", "watch"]),
    ("", "pods/status", &["patch"]),
    // Events (events.k8s.io/v1: created, then patched as a series).
    ("events.k8s.io", "events", &["create", "patch"]),
];

/// Granted only in the operator's own namespace: the leader-election Lease.
pub const OWN_NAMESPACE: &[(&str, &str, &[&str])] = &[("coordination.k8s.io", "leases", &["create", "get", "update"])];
