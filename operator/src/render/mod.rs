//! The objects an `InferenceDeployment` owns, built from its spec. Pure: no I/O.

pub mod engine;
pub mod inference_pool;
pub mod placement;
pub mod pod_options;
pub mod revision;
pub mod router;
pub mod secret;
pub mod vllm_connector;
pub mod workers;

use crate::labels;
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Resource;
use kvgate_proto::contract;

use crate::crd::InferenceDeployment;

/// Ports the router and decode's KV listener use (on the pod IP); the worker roles' HTTP ports
/// are `Role::port()`. All are the worker's defaults (`proto::contract`).
pub const ROUTER_PORT: i32 = contract::ROUTER_PORT as i32;
pub const KV_PORT: i32 = contract::KV_PORT as i32;

/// Where the handoff secret is mounted in decode pods.
pub const SECRET_DIR: &str = "/var/run/kvgate/handoff";
/// Where a checkpoint volume is mounted.
pub const MODEL_DIR: &str = "/models";

/// Metadata of an owned object: its name, the deployment's namespace and labels, and an owner
/// reference so that deleting the deployment deletes it.
pub fn owned_meta(d: &InferenceDeployment, name: String, labels: std::collections::BTreeMap<String, String>) -> ObjectMeta {
    ObjectMeta { name: Some(name), namespace: d.metadata.namespace.clone(), labels: Some(labels), owner_references: Some(vec![owner(d)]), ..Default::default() }
}

pub fn owner(d: &InferenceDeployment) -> OwnerReference {
    let mut o = d.controller_owner_ref(&()).expect("an InferenceDeployment read from the API has a name and uid");
    o.block_owner_deletion = Some(true);
    o
}

/// The deployment's API, `<name>` port 80, in front of `component`'s pods (the routers, or an
/// engine's servers): only Ready ones, which for gated pods means verified.
pub fn api_service(d: &InferenceDeployment, component: &str) -> Service {
    let n = name(d);
    Service {
        metadata: owned_meta(d, n.to_string(), labels::with(labels::common(n), labels::role_selector(n, component))),
        spec: Some(ServiceSpec {
            selector: Some(labels::role_selector(n, component)),
            ports: Some(vec![ServicePort { name: Some("http".into()), port: 80, target_port: Some(IntOrString::String("http".into())), ..Default::default() }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub fn name(d: &InferenceDeployment) -> &str {
    d.metadata.name.as_deref().unwrap_or_default()
}
