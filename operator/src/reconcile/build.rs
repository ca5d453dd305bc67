//! Build: what a plan means in objects. A pure step (no client, no store: what it must know of
//! the cluster it is given) that turns `decide`'s plan into the writes `apply` makes, in order:
//! which objects each engine renders, which Services a revision needs, which go with a retired
//! Deployment, and whether the handoff Secret must exist. `apply` writes them without knowing
//! any engine.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role as RbacRole, RoleBinding};

use super::decide::Plan;
use crate::crd::InferenceDeployment;
use crate::gate::Role;
use crate::render::workers::Telemetry;
use crate::render::{engine, router, vllm_connector, workers};

/// An object the operator owns, as it should be. (A dozen per pass, built and written at once:
/// their sizes do not matter.)
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)]
pub enum Desired {
    ConfigMap(ConfigMap),
    Service(Service),
    ServiceAccount(ServiceAccount),
    Role(RbacRole),
    RoleBinding(RoleBinding),
    Deployment(Deployment),
}

/// One write, in the order `apply` makes them.
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)]
pub enum Write {
    Apply(Desired),
    DeleteDeployment(String),
    DeleteService(String),
}

/// Everything a plan asks to be written besides pod conditions, status and Events.
#[derive(Debug, Clone, PartialEq)]
pub struct Objects {
    /// The deployment's handoff Secret must exist (created, never applied: see `apply`).
    pub handoff_secret: bool,
    pub writes: Vec<Write>,
}

/// The objects of `plan` for `d` running `image` (the spec's); `service_exists` says whether a
/// Service of that name is in the deployment's namespace (a retired disaggregated revision's
/// headless Service goes with its Deployment).
pub fn objects(d: &InferenceDeployment, image: &str, plan: &Plan, telemetry: &Telemetry, service_exists: impl Fn(&str) -> bool) -> Objects {
    let integrity = d.spec.engine().integrity();
    let mut writes = Vec::new();
    let mut apply = |o: Desired| writes.push(Write::Apply(o));
    if d.spec.engine_verifies_handoffs() {
        // Immutable, its name carrying its digest: applied once, and again only if it is gone.
        apply(Desired::ConfigMap(vllm_connector::config_map(d)));
    }
    if integrity {
        for svc in [workers::service(d, Role::Prefill), workers::service(d, Role::Decode), router::api_service(d)] {
            apply(Desired::Service(svc));
        }
        apply(Desired::ServiceAccount(router::service_account(d)));
        apply(Desired::Role(router::role(d)));
        apply(Desired::RoleBinding(router::role_binding(d)));
    } else {
        apply(Desired::Service(engine::api_service(d)));
    }
    for w in &plan.workers {
        let dep = if integrity {
            workers::deployment(d, w.role, &w.revision, image, w.replicas, telemetry)
        } else {
            if w.role == Role::Router {
                // A disaggregated revision: its router reaches prefill and decode through these.
                for role in [Role::Prefill, Role::Decode] {
                    apply(Desired::Service(engine::revision_service(d, role, &w.revision)));
                }
            }
            engine::deployment(d, w.role, &w.revision, w.replicas)
        };
        apply(Desired::Deployment(dep));
    }
    for dep in &plan.delete {
        writes.push(Write::DeleteDeployment(dep.clone()));
        if !integrity && service_exists(dep) {
            writes.push(Write::DeleteService(dep.clone()));
        }
    }
    if let Some(window) = plan.router_window {
        let image = plan.router_image.as_deref().unwrap_or(image);
        writes.push(Write::Apply(Desired::Deployment(router::deployment(d, image, window, telemetry))));
    }
    Objects { handoff_secret: d.spec.handoff_secret(), writes }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::crd::InferenceDeploymentStatus;
    use crate::reconcile::decide::WorkerDeployment;
    use crate::render::workers::Telemetry;

    fn plan(workers: &[(Role, &str)], delete: &[&str], router_window: Option<u64>) -> Plan {
        Plan {
            workers: workers.iter().map(|(role, revision)| WorkerDeployment { role: *role, revision: revision.to_string(), replicas: 1 }).collect(),
            delete: delete.iter().map(|d| d.to_string()).collect(),
            router_window,
            router_image: None,
            pod_gates: vec![],
            events: vec![],
            refused_reason: None,
            status: InferenceDeploymentStatus::default(),
            settled: false,
            canary: None,
            serving_probe: None,
            unverified: vec![],
            rollback: None,
            scrape: None,
            recreate_secret: false,
        }
    }

    /// Each write as `verb Kind/name`, in order.
    fn writes(o: &Objects) -> Vec<String> {
        o.writes
            .iter()
            .map(|w| match w {
                Write::Apply(Desired::ConfigMap(c)) => format!("apply ConfigMap/{}", c.metadata.name.as_deref().unwrap_or_default()),
                Write::Apply(Desired::Service(s)) => format!("apply Service/{}", s.metadata.name.as_deref().unwrap_or_default()),
                Write::Apply(Desired::ServiceAccount(s)) => format!("apply ServiceAccount/{}", s.metadata.name.as_deref().unwrap_or_default()),
                Write::Apply(Desired::Role(r)) => format!("apply Role/{}", r.metadata.name.as_deref().unwrap_or_default()),
                Write::Apply(Desired::RoleBinding(b)) => format!("apply RoleBinding/{}", b.metadata.name.as_deref().unwrap_or_default()),
                Write::Apply(Desired::Deployment(d)) => format!("apply Deployment/{}", d.metadata.name.as_deref().unwrap_or_default()),
                Write::DeleteDeployment(n) => format!("delete Deployment/{n}"),
                Write::DeleteService(n) => format!("delete Service/{n}"),
            })
            .collect()
    }

    fn kvgate() -> InferenceDeployment {
        InferenceDeployment::for_test(json!({
            "model": { "name": "tiny" }, "contextWindow": 2048,
            "prefill": { "replicas": 1, "kvPool": { "tokens": 8192 } }, "decode": { "replicas": 1, "kvPool": { "tokens": 8192 } },
        }))
    }

    fn vllm(verify: bool) -> InferenceDeployment {
        let args = if verify { json!(["--kv-transfer-config", r#"{"kv_connector":"NixlConnector","kv_role":"kv_both"}"#]) } else { json!([]) };
        let container = json!({ "name": "vllm", "image": "v", "args": args });
        InferenceDeployment::for_test(json!({
            "engine": "vllm", "model": { "name": "m" }, "contextWindow": 2048,
            "prefill": { "replicas": 1, "container": container }, "decode": { "replicas": 1, "container": container },
            "router": { "replicas": 1, "container": { "name": "router", "image": "r" } },
        }))
    }

    #[test]
    fn each_engine_gets_its_objects_in_the_order_they_are_written() {
        let t = Telemetry::logging(kvgate_telemetry::LogFormat::Json);
        let no_service = |_: &str| false;
        let cases: [(&str, InferenceDeployment, Plan, bool, &[&str]); 3] = [
            (
                "kvgate: Services, the router's identity, the revision, the old one retired, the router last",
                kvgate(),
                plan(&[(Role::Prefill, "r2"), (Role::Decode, "r2")], &["llm-prefill-r1"], Some(2048)),
                true,
                &[
                    "apply Service/llm-prefill",
                    "apply Service/llm-decode",
                    "apply Service/llm",
                    "apply ServiceAccount/llm-router",
                    "apply Role/llm-router",
                    "apply RoleBinding/llm-router",
                    "apply Deployment/llm-prefill-r2",
                    "apply Deployment/llm-decode-r2",
                    "delete Deployment/llm-prefill-r1",
                    "apply Deployment/llm-router",
                ],
            ),
            (
                "vLLM with kvgate's connector: its package first, the revision's Services before its router",
                vllm(true),
                plan(&[(Role::Prefill, "r1"), (Role::Decode, "r1"), (Role::Router, "r1")], &[], None),
                true,
                &[
                    "apply ConfigMap/",
                    "apply Service/llm",
                    "apply Deployment/llm-prefill-r1",
                    "apply Deployment/llm-decode-r1",
                    "apply Service/llm-prefill-r1",
                    "apply Service/llm-decode-r1",
                    "apply Deployment/llm-router-r1",
                ],
            ),
            (
                "vLLM unverified: no Secret, no package",
                vllm(false),
                plan(&[(Role::Prefill, "r1")], &["llm-prefill-r0"], None),
                false,
                &["apply Service/llm", "apply Deployment/llm-prefill-r1", "delete Deployment/llm-prefill-r0"],
            ),
        ];
        for (what, d, p, secret, want) in cases {
            let o = objects(&d, "worker:1", &p, &t, no_service);
            assert_eq!(o.handoff_secret, secret, "{what}");
            let got = writes(&o);
            assert_eq!(got.len(), want.len(), "{what}: {got:#?}");
            for (g, w) in got.iter().zip(want.iter()) {
                assert!(g.starts_with(w), "{what}: {g} where {w} was expected, in {got:#?}");
            }
        }
    }

    #[test]
    fn a_retired_disaggregated_revision_takes_its_headless_service_along_only_when_it_exists() {
        let t = Telemetry::logging(kvgate_telemetry::LogFormat::Json);
        let p = plan(&[], &["llm-prefill-r0", "llm-decode-r0"], None);
        let o = objects(&vllm(true), "worker:1", &p, &t, |n| n == "llm-prefill-r0");
        let deletes: Vec<String> = writes(&o).into_iter().filter(|w| w.starts_with("delete")).collect();
        assert_eq!(deletes, ["delete Deployment/llm-prefill-r0", "delete Service/llm-prefill-r0", "delete Deployment/llm-decode-r0"]);
        // kvgate's roles have no per-revision Service: nothing else is ever deleted with them.
        let o = objects(&kvgate(), "worker:1", &p, &t, |_| true);
        assert!(writes(&o).iter().all(|w| !w.starts_with("delete Service")), "{:?}", writes(&o));
    }
}
