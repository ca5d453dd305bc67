//! What the watch cache keeps of each owned object: its metadata and what the reconcile reads.
//! Specs are most of an object's memory, and an apply only needs the digest of the fields it owns
//! (`digests`) to know whether anything it sets differs; with 1,000 deployments the whole objects
//! held most of the operator's memory.

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::Resource;
use serde::Serialize;

/// Where a cached Deployment carries its first container's image, in the operator's memory only
/// (the watch sets it on what it caches, and nothing cached is sent back): the one field of its
/// spec the reconcile reads (a `Container` alone is 2.3 KB, most of them empty).
const IMAGE: &str = "kvgate.dev/first-container-image";

/// A kind as the watch cache keeps it.
pub trait Cached: Resource + Serialize {
    /// Whether the operator applies objects of this kind (and so compares their digest).
    const APPLIED: bool = true;
    /// Drops what neither the reconcile reads nor an apply compares.
    fn trim(&mut self);
}

/// Prepares a watched object for the cache (after `Digests` took its digest): without managed
/// fields, trimmed.
pub fn compact<K: Cached>(o: &mut K) {
    o.meta_mut().managed_fields = None;
    o.trim();
}

impl Cached for Deployment {
    /// The reconcile reads a Deployment's labels, owners, status and first container's image
    /// (`image`).
    fn trim(&mut self) {
        let image = self.spec.template.spec.take().and_then(|s| s.containers.into_iter().next()?.image);
        self.spec = DeploymentSpec::default();
        let annotations = self.metadata.annotations.get_or_insert_default();
        match image {
            Some(image) => annotations.insert(IMAGE.into(), image),
            None => annotations.remove(IMAGE),
        };
    }
}

/// The first container's image of a cached Deployment.
pub fn image(cached: &Deployment) -> Option<&str> {
    cached.metadata.annotations.as_ref()?.get(IMAGE).map(String::as_str)
}

/// Of these kinds the reconcile reads nothing but their owner (which deployment to wake), name
/// and version: labels go with the spec.
impl Cached for Service {
    fn trim(&mut self) {
        self.metadata.labels = None;
        self.spec = None;
        self.status = None;
    }
}

impl Cached for ServiceAccount {
    fn trim(&mut self) {
        self.metadata.labels = None;
        self.secrets = None;
        self.image_pull_secrets = None;
    }
}

/// kvgate's vLLM connector package: the reconcile reads only that it exists (its digest, of
/// the files it was applied with, is kept beside it).
impl Cached for ConfigMap {
    fn trim(&mut self) {
        self.metadata.labels = None;
        self.data = None;
        self.binary_data = None;
    }
}

impl Cached for Role {
    fn trim(&mut self) {
        self.metadata.labels = None;
        self.rules = None;
    }
}

impl Cached for RoleBinding {
    fn trim(&mut self) {
        self.metadata.labels = None;
        self.subjects = None;
        self.role_ref = Default::default();
    }
}

/// Pods come from ReplicaSets, not from this operator's applies, and the reconcile reads them
/// whole (status, containers, annotations).
impl Cached for Pod {
    const APPLIED: bool = false;
    fn trim(&mut self) {}
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use serde_json::json;

    /// A Deployment as the API server stores one this operator applied, and what it applied.
    pub(in crate::watch) fn applied_deployment() -> (serde_json::Value, Deployment) {
        let body = json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": { "name": "d", "namespace": "ns", "labels": { "kvgate.dev/revision": "r1" } },
            "spec": { "replicas": 1, "selector": { "matchLabels": { "a": "b" } },
                      "template": { "metadata": { "labels": { "a": "b" } }, "spec": { "containers": [{ "name": "w", "image": "img:1", "args": ["x"] }] } } }
        });
        let mut stored = body.clone();
        stored["metadata"]["resourceVersion"] = json!("5");
        stored["metadata"]["uid"] = json!("u-1");
        stored["metadata"]["managedFields"] = json!([{ "manager": crate::labels::MANAGER, "operation": "Apply", "apiVersion": "apps/v1", "fieldsType": "FieldsV1", "fieldsV1": {
            "f:metadata": { "f:labels": { "f:kvgate.dev/revision": {} } },
            "f:spec": { "f:replicas": {}, "f:selector": {}, "f:template": { "f:metadata": { "f:labels": { "f:a": {} } },
                "f:spec": { "f:containers": { "k:{\"name\":\"w\"}": { ".": {}, "f:name": {}, "f:image": {}, "f:args": {} } } } } } } }]);
        stored["status"] = json!({ "readyReplicas": 1 });
        (body, serde_json::from_value(stored).unwrap())
    }

    #[test]
    fn a_cached_deployment_keeps_what_the_reconcile_reads() {
        let (_, mut cached) = applied_deployment();
        compact(&mut cached);
        assert!(cached.metadata.managed_fields.is_none());
        assert_eq!(cached.metadata.labels.as_ref().unwrap()["kvgate.dev/revision"], "r1");
        assert_eq!(cached.status.as_ref().unwrap().ready_replicas, Some(1));
        assert_eq!(image(&cached), Some("img:1"));
        assert!(cached.spec.template.spec.is_none(), "the spec is not kept");
    }

    #[test]
    fn an_image_annotation_set_by_someone_else_is_not_believed() {
        let mut dep: Deployment = serde_json::from_value(json!({ "metadata": { "name": "d", "annotations": { IMAGE: "evil:1" } },
            "spec": { "selector": {}, "template": { "spec": { "containers": [] } } } }))
        .unwrap();
        compact(&mut dep);
        assert_eq!(image(&dep), None);
    }
}
