//! Step 4: the workloads. The spec's revision's Deployments at the size they should have (zero
//! while it stands refused), the Deployments of revisions that neither serve, bake nor are the
//! candidate (deleted), and the router: the serving revision's window and image.

use super::{Inputs, Rollout};
use crate::gate::Role;

/// One revision's worker Deployment at the size it should have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerDeployment {
    pub role: Role,
    pub revision: String,
    pub replicas: i32,
}

pub(super) struct Workloads {
    pub workers: Vec<WorkerDeployment>,
    pub delete: Vec<String>,
    pub router_window: Option<u64>,
    pub router_image: Option<String>,
}

pub(super) fn plan(i: &Inputs<'_>, r: &Rollout) -> Workloads {
    let rev = i.revision;
    let workers = match i.host_path_refusal {
        Some(_) => Vec::new(),
        None => {
            i.d.spec
                .roles()
                .iter()
                .map(|&role| WorkerDeployment { role, revision: rev.into(), replicas: if r.scale_to_zero { 0 } else { i.d.spec.replicas(role) } })
                .collect()
        }
    };
    let kept = r.bake.as_ref().map(|b| b.previous.as_str());
    let delete = i
        .world
        .deployments
        .iter()
        .filter(|dep| dep.revision != rev && Some(dep.revision.as_str()) != r.serving.as_deref() && Some(dep.revision.as_str()) != kept)
        .map(|dep| dep.name.clone())
        .collect();
    // The router admits what the serving revision was verified for, and runs its image.
    let router_window = r.serving_window.unwrap_or(i.window());
    let router_image = r.serving.as_ref().and_then(|s| i.world.deployments.iter().filter(|dep| &dep.revision == s).find_map(|dep| dep.image.clone()));
    // kvgate's router fronts every revision; an external engine's router, if any, is one of
    // its revision's roles.
    let routed = i.host_path_refusal.is_none() && i.d.spec.engine().integrity();
    Workloads { workers, delete, router_window: routed.then_some(router_window), router_image }
}

#[cfg(test)]
mod tests {
    use super::super::tests::*;

    #[test]
    fn a_bake_keeps_the_previous_revision_and_deletes_only_what_nothing_needs() {
        let (mut d, mut world) = bake_from_r1(4096);
        // A revision refused long ago still has Deployments.
        revision(&mut world, &d, "r0", Ok(report(8192, "l")), false);
        let plan = pass_at(&mut d, "r2", &world, 1_000);
        assert_eq!(plan.status.bake.as_ref().map(|b| b.previous.as_str()), Some("r1"));
        assert_eq!(plan.delete, ["llm-prefill-r0", "llm-decode-r0"], "r1 bakes beside r2; r0 has no use");
        assert_eq!((plan.router_window, plan.router_image.as_deref()), (Some(4096), Some("worker:r2")));
    }
}
