//! Where a role's pods run: the spec's node selector, tolerations and affinity as given, and
//! topology spread as given or, by default, across nodes. Disaggregation exists to put prefill
//! and decode on different machines: by default the prefill and decode pods of one revision
//! spread together over `kubernetes.io/hostname` (so with two nodes, one of each per node), and
//! routers, or an engine's servers, spread among themselves. `ScheduleAnyway`: a preference the
//! scheduler weighs, never a reason to leave a pod pending on a cluster of one node.

use k8s_openapi::api::core::v1::{PodSpec, TopologySpreadConstraint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

use super::labels;
use crate::crd::{InferenceDeployment, Placement};
use crate::gate::Role;

pub const HOSTNAME: &str = "kubernetes.io/hostname";

/// The pods a default spread counts: `components` of the deployment, of `revision` if given.
fn spread(d: &InferenceDeployment, components: &[&str], revision: Option<&str>) -> TopologySpreadConstraint {
    let n = super::name(d);
    let mut match_labels = std::collections::BTreeMap::from([(labels::INSTANCE.to_string(), n.to_string())]);
    match_labels.extend(revision.map(|r| (labels::REVISION.to_string(), r.to_string())));
    let components =
        LabelSelectorRequirement { key: labels::COMPONENT.into(), operator: "In".into(), values: Some(components.iter().map(|c| c.to_string()).collect()) };
    TopologySpreadConstraint {
        max_skew: 1,
        topology_key: HOSTNAME.into(),
        when_unsatisfiable: "ScheduleAnyway".into(),
        label_selector: Some(LabelSelector { match_labels: Some(match_labels), match_expressions: Some(vec![components]) }),
        ..Default::default()
    }
}

/// The default spread of `role`'s pods at `revision` (the router has none: it is not a revision's).
fn default_spread(d: &InferenceDeployment, role: Option<Role>, revision: Option<&str>) -> TopologySpreadConstraint {
    match role {
        Some(Role::Prefill | Role::Decode) => spread(d, &[Role::Prefill.as_str(), Role::Decode.as_str()], revision),
        Some(Role::Server) => spread(d, &[Role::Server.as_str()], revision),
        None => spread(d, &[super::router::COMPONENT], None),
    }
}

/// `spec` placed as the spec's `p` says: `role` `None` is the router.
pub fn placed(mut spec: PodSpec, d: &InferenceDeployment, p: &Placement, role: Option<Role>, revision: Option<&str>) -> PodSpec {
    spec.node_selector = p.node_selector.clone();
    spec.tolerations = p.tolerations.clone();
    spec.affinity = p.affinity.clone();
    spec.topology_spread_constraints = match &p.topology_spread_constraints {
        Some(given) => (!given.is_empty()).then(|| given.clone()),
        None => Some(vec![default_spread(d, role, revision)]),
    };
    spec
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(prefill_placement: serde_json::Value) -> InferenceDeployment {
        let mut prefill = json!({ "kvPool": {} });
        prefill.as_object_mut().unwrap().extend(prefill_placement.as_object().unwrap().clone());
        InferenceDeployment::for_test(json!({ "model": { "name": "tiny" }, "contextWindow": 64, "prefill": prefill, "decode": { "kvPool": {} } }))
    }

    fn rendered(d: &InferenceDeployment, role: Option<Role>) -> PodSpec {
        let p = match role {
            Some(r) => d.spec.worker(r).placement.clone(),
            None => d.spec.router.placement.clone(),
        };
        placed(PodSpec::default(), d, &p, role, Some("rev1"))
    }

    #[test]
    fn by_default_prefill_and_decode_of_a_revision_spread_together_across_nodes_softly() {
        let d = spec(json!({}));
        let prefill = rendered(&d, Some(Role::Prefill)).topology_spread_constraints.unwrap();
        let decode = rendered(&d, Some(Role::Decode)).topology_spread_constraints.unwrap();
        assert_eq!(prefill, decode, "one spread counts both roles");
        let c = &prefill[0];
        assert_eq!((c.topology_key.as_str(), c.max_skew, c.when_unsatisfiable.as_str()), (HOSTNAME, 1, "ScheduleAnyway"));
        let selector = serde_json::to_value(c.label_selector.as_ref().unwrap()).unwrap();
        assert_eq!(
            selector,
            json!({
                "matchLabels": { "app.kubernetes.io/instance": "llm", "kvgate.dev/revision": "rev1" },
                "matchExpressions": [{ "key": "app.kubernetes.io/component", "operator": "In", "values": ["prefill", "decode"] }],
            })
        );
        let router = rendered(&d, None).topology_spread_constraints.unwrap();
        assert_eq!(serde_json::to_value(&router[0].label_selector).unwrap()["matchExpressions"][0]["values"], json!(["router"]));
        assert!(serde_json::to_value(&router[0].label_selector).unwrap()["matchLabels"].get("kvgate.dev/revision").is_none());
    }

    #[test]
    fn the_spec_overrides_the_spread_and_passes_affinity_selector_and_tolerations_through() {
        let affinity = json!({ "nodeAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": { "nodeSelectorTerms": [
            { "matchExpressions": [{ "key": "gpu", "operator": "In", "values": ["h200"] }] }] } } });
        let own = json!([{ "maxSkew": 2, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule" }]);
        let d = spec(json!({ "affinity": affinity, "topologySpreadConstraints": own, "nodeSelector": { "pool": "prefill" },
            "tolerations": [{ "key": "gpu", "operator": "Exists" }] }));
        let s = rendered(&d, Some(Role::Prefill));
        assert_eq!(serde_json::to_value(&s.affinity).unwrap(), affinity);
        assert_eq!(serde_json::to_value(&s.topology_spread_constraints).unwrap(), own);
        assert_eq!(s.node_selector.unwrap()["pool"], "prefill");
        assert_eq!(s.tolerations.unwrap()[0].key.as_deref(), Some("gpu"));
        // Decode keeps the default; an empty list turns spreading off.
        assert!(rendered(&d, Some(Role::Decode)).topology_spread_constraints.is_some());
        let off = spec(json!({ "topologySpreadConstraints": [] }));
        assert_eq!(rendered(&off, Some(Role::Prefill)).topology_spread_constraints, None);
    }
}
