//! The optional `InferencePool` (Gateway API Inference Extension, `inference.networking.k8s.io/v1`)
//! over the pods that serve a deployment's API, so a gateway's endpoint picker can score them by
//! the model server protocol's metrics (docs/observability.md, "What a gateway reads").
//!
//! It selects exactly what the deployment's Service selects: the routers (engine kvgate) or the
//! engine's servers. Pods of a candidate revision share those labels but are not Ready until the
//! gate verified them, and a picker only sends to Ready pods, as the Service does.

use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::json;

use super::{name, owned_meta};
use crate::crd::InferenceDeployment;
use crate::labels;

pub const GROUP: &str = "inference.networking.k8s.io";
pub const VERSION: &str = "v1";
pub const KIND: &str = "InferencePool";

pub fn api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, KIND), "inferencepools")
}

/// The pool `spec.inferencePool` asks for, named like the deployment; `None` when it asks none.
pub fn pool(d: &InferenceDeployment) -> Option<DynamicObject> {
    let wanted = d.spec.inference_pool.as_ref()?;
    let n = name(d);
    let role = d.spec.engine().api_role(&d.spec);
    let component = role.as_str();
    let port = i32::from(d.spec.port(role));
    let picker = &wanted.endpoint_picker;
    let mut obj = DynamicObject::new(n, &api_resource());
    obj.metadata = owned_meta(d, n.to_string(), labels::with(labels::common(n), labels::role_selector(n, component)));
    obj.data = json!({ "spec": {
        "selector": { "matchLabels": labels::role_selector(n, component) },
        "targetPorts": [{ "number": port }],
        "endpointPickerRef": {
            "kind": "Service",
            "name": picker.name,
            "port": { "number": picker.port },
            "failureMode": picker.failure_mode,
        },
    }});
    Some(obj)
}

#[cfg(test)]
mod tests {
    use super::super::ROUTER_PORT;
    use super::*;

    fn deployment(spec: serde_json::Value) -> InferenceDeployment {
        InferenceDeployment::for_test(spec)
    }

    #[test]
    fn the_pool_selects_what_the_api_service_selects_on_its_target_port() {
        let kvgate = deployment(json!({
            "model": { "name": "tiny" }, "contextWindow": 64, "prefill": { "kvPool": {} }, "decode": { "kvPool": {} },
            "inferencePool": { "endpointPicker": { "name": "epp" } },
        }));
        let p = pool(&kvgate).unwrap();
        let service = super::super::router::api_service(&kvgate);
        assert_eq!(p.data["spec"]["selector"]["matchLabels"], json!(service.spec.unwrap().selector.unwrap()));
        assert_eq!(p.data["spec"]["targetPorts"], json!([{ "number": ROUTER_PORT }]));
        assert_eq!(p.data["spec"]["endpointPickerRef"], json!({ "kind": "Service", "name": "epp", "port": { "number": 9002 }, "failureMode": "FailClose" }));
        assert_eq!(p.metadata.owner_references.unwrap()[0].uid, "uid-1", "deleted with its deployment");

        let vllm = deployment(json!({
            "engine": "vllm", "model": { "path": "m", "volume": { "hostPath": "/m" } }, "contextWindow": 64,
            "server": { "container": { "name": "vllm", "image": "vllm" }, "port": 8100 },
            "inferencePool": { "endpointPicker": { "name": "epp", "port": 9100, "failureMode": "FailOpen" } },
        }));
        let p = pool(&vllm).unwrap();
        assert_eq!(p.data["spec"]["selector"]["matchLabels"][labels::COMPONENT], "server");
        assert_eq!(p.data["spec"]["targetPorts"], json!([{ "number": 8100 }]));
        assert_eq!(p.data["spec"]["endpointPickerRef"]["failureMode"], "FailOpen");

        let none = deployment(json!({ "model": { "name": "tiny" }, "contextWindow": 64, "prefill": { "kvPool": {} }, "decode": { "kvPool": {} } }));
        assert!(pool(&none).is_none());
    }
}
