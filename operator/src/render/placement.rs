//! Where a role's pods run: the spec's node selector, tolerations and affinity as given, and
//! topology spread as given or, by default, across nodes (`kubernetes.io/hostname`): each role's
//! pods of one revision among themselves, so losing a machine never takes all of one role (two
//! nodes and two of each: one prefill and one decode per node). Routers, or an engine's servers,
//! spread among themselves. `ScheduleAnyway`: a preference the scheduler weighs, never a reason
//! to leave a pod pending on a cluster of one node. (A second spread counting prefill and decode
//! together cannot be added: the API allows one constraint per topology key and
//! `whenUnsatisfiable`, and counting them together alone let two nodes each hold one role.)
//!
//! A pod on a node that stops answering is evicted after 30 s, not the API server's default
//! 300 s (`DefaultTolerationSeconds`): the node lifecycle controller has already taken it out of
//! its Service's endpoints, and five minutes at reduced capacity is a long time for a serving
//! fleet. A toleration of the spec's for the same taint replaces ours.

use k8s_openapi::api::core::v1::{PodSpec, Toleration, TopologySpreadConstraint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

use crate::crd::{InferenceDeployment, Placement};
use crate::gate::Role;
use crate::labels;

pub const HOSTNAME: &str = "kubernetes.io/hostname";

/// The taints a lost node gets, and how long a pod stays bound to one.
pub const NODE_LOST_TAINTS: [&str; 2] = ["node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"];
pub const NODE_LOST_EVICTION_SECONDS: i64 = 30;

/// The spec's tolerations, then ours for a lost node's taints the spec does not name.
fn tolerations(given: Option<&Vec<Toleration>>) -> Vec<Toleration> {
    let mut all = given.cloned().unwrap_or_default();
    for key in NODE_LOST_TAINTS {
        if !all.iter().any(|t| t.key.as_deref() == Some(key)) {
            all.push(Toleration {
                key: Some(key.into()),
                operator: Some("Exists".into()),
                effect: Some("NoExecute".into()),
                toleration_seconds: Some(NODE_LOST_EVICTION_SECONDS),
                ..Default::default()
            });
        }
    }
    all
}

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
        Some(role) => spread(d, &[role.as_str()], revision),
        None => spread(d, &[crate::role::Role::Router.as_str()], None),
    }
}

/// `spec` placed as the spec's `p` says: `role` `None` is the router.
pub fn placed(mut spec: PodSpec, d: &InferenceDeployment, p: &Placement, role: Option<Role>, revision: Option<&str>) -> PodSpec {
    spec.node_selector = p.node_selector.clone();
    spec.tolerations = Some(tolerations(p.tolerations.as_ref()));
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
    fn by_default_each_role_spreads_across_nodes_softly() {
        let d = spec(json!({}));
        let selector = |c: &TopologySpreadConstraint| serde_json::to_value(c.label_selector.as_ref().unwrap()).unwrap();
        for role in [Role::Prefill, Role::Decode] {
            let spread = rendered(&d, Some(role)).topology_spread_constraints.unwrap();
            assert_eq!(spread.len(), 1, "the API allows one constraint per topology key and whenUnsatisfiable");
            let c = &spread[0];
            assert_eq!((c.topology_key.as_str(), c.max_skew, c.when_unsatisfiable.as_str()), (HOSTNAME, 1, "ScheduleAnyway"));
            assert_eq!(
                selector(c),
                json!({
                    "matchLabels": { "app.kubernetes.io/instance": "llm", "kvgate.dev/revision": "rev1" },
                    "matchExpressions": [{ "key": "app.kubernetes.io/component", "operator": "In", "values": [role.as_str()] }],
                })
            );
        }
        let router = rendered(&d, None).topology_spread_constraints.unwrap();
        assert_eq!(selector(&router[0])["matchExpressions"][0]["values"], json!(["router"]));
        assert!(selector(&router[0])["matchLabels"].get("kvgate.dev/revision").is_none());
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

    #[test]
    fn pods_leave_a_lost_node_after_30_seconds_unless_the_spec_says_otherwise() {
        let lost = |s: &PodSpec| -> Vec<(String, Option<i64>)> {
            s.tolerations
                .iter()
                .flatten()
                .filter(|t| t.effect.as_deref() == Some("NoExecute"))
                .map(|t| (t.key.clone().unwrap(), t.toleration_seconds))
                .collect()
        };
        let d = spec(json!({ "tolerations": [{ "key": "gpu", "operator": "Exists" }] }));
        let want = vec![("node.kubernetes.io/not-ready".to_string(), Some(30)), ("node.kubernetes.io/unreachable".to_string(), Some(30))];
        for role in [Some(Role::Prefill), Some(Role::Decode), None] {
            assert_eq!(lost(&rendered(&d, role)), want, "{role:?}");
        }
        assert_eq!(rendered(&d, Some(Role::Prefill)).tolerations.unwrap()[0].key.as_deref(), Some("gpu"), "the spec's come first");
        // The spec's own toleration for a taint replaces ours for that taint only.
        let own = spec(
            json!({ "tolerations": [{ "key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 600 }] }),
        );
        assert_eq!(
            lost(&rendered(&own, Some(Role::Prefill))),
            vec![("node.kubernetes.io/unreachable".to_string(), Some(600)), ("node.kubernetes.io/not-ready".to_string(), Some(30))]
        );
    }
}
