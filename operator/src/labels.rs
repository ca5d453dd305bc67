//! Labels on everything the operator creates; selectors are built from the same functions.

use std::collections::BTreeMap;

pub const INSTANCE: &str = "app.kubernetes.io/instance";
pub const COMPONENT: &str = "app.kubernetes.io/component";
pub const REVISION: &str = "kvgate.dev/revision";
/// On pods: the UID of their InferenceDeployment (a deleted namesake's pods are not its own).
pub const DEPLOYMENT_UID: &str = "kvgate.dev/deployment-uid";
pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const OPERATOR: &str = "kvgate-operator";
/// The field manager of everything the operator applies (server-side apply).
pub const MANAGER: &str = OPERATOR;

/// Labels of all objects of one deployment.
pub fn common(name: &str) -> BTreeMap<String, String> {
    [
        ("app.kubernetes.io/name".to_string(), "kvgate".to_string()),
        (INSTANCE.to_string(), name.to_string()),
        (MANAGED_BY.to_string(), OPERATOR.to_string()),
        ("app.kubernetes.io/version".to_string(), env!("CARGO_PKG_VERSION").to_string()),
    ]
    .into()
}

/// Selector of one role's pods (every revision).
pub fn role_selector(name: &str, role: &str) -> BTreeMap<String, String> {
    [(INSTANCE.to_string(), name.to_string()), (COMPONENT.to_string(), role.to_string())].into()
}

/// Selector of one role's pods of one revision.
pub fn revision_selector(name: &str, role: &str, revision: &str) -> BTreeMap<String, String> {
    let mut s = role_selector(name, role);
    s.insert(REVISION.to_string(), revision.to_string());
    s
}

/// Labels of a pod template: the object's labels and the deployment's UID.
pub fn pod(base: BTreeMap<String, String>, uid: Option<&str>) -> BTreeMap<String, String> {
    with(base, uid.map(|u| (DEPLOYMENT_UID.to_string(), u.to_string())).into_iter().collect())
}

pub fn with(mut base: BTreeMap<String, String>, extra: BTreeMap<String, String>) -> BTreeMap<String, String> {
    base.extend(extra);
    base
}

/// `k=v,k=v` for list calls.
pub fn selector_string(s: &BTreeMap<String, String>) -> String {
    s.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}
