//! Observe: everything one reconcile reads, and nothing it writes; no API call and no wait. The
//! Deployments it owns and the pods of its workers come from the watch-fed stores; each pod's
//! capacity report (verified with the deployment's derived key), the mismatch counters and the
//! canary's result from the background tasks, which this asks for what it will need next.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Pod, PodCondition};
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;

use super::context::Context;
use super::inference_pool::PoolCondition;
use super::pod_problems::{self, StuckPod};
use crate::crd::{CanaryStatus, InferenceDeployment};
use crate::gate::{self, Measured, Role};
use crate::labels;
use crate::render::router;
use crate::tasks::probes::{Source, Target};
use crate::tasks::scrapes::Endpoint;
use crate::watch::cached;

pub use crate::capacity::NoReport;

/// A Deployment this InferenceDeployment owns for one revision of its workers.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnedDeployment {
    pub name: String,
    pub revision: String,
    pub ready: i32,
    /// The worker image its pods run.
    pub image: Option<String>,
}

/// A worker pod (not terminating), what it reported and the gate condition it carries.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerPod {
    pub name: String,
    pub role: Role,
    pub revision: String,
    /// The pod's IP, once it has one.
    pub ip: Option<String>,
    /// What the pod measured (a kvgate worker's verified report, or its engine's answer), or
    /// why there is none.
    pub report: Result<Measured, NoReport>,
    pub condition: Option<PodCondition>,
    /// Its containers pass their own readiness probes (the pod's `ContainersReady`).
    pub containers_ready: bool,
}

/// The world as one reconcile found it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct World {
    pub deployments: Vec<OwnedDeployment>,
    /// Ready pods of the router Deployment (`None`: there is none).
    pub router_ready: Option<i32>,
    pub pods: Vec<WorkerPod>,
    /// The deployment's KV pods' integrity counters (`engines::integrity`), summed by name;
    /// scraped once a revision serves (`decide`'s `Plan::scrape`).
    pub mismatches: Option<BTreeMap<String, u64>>,
    /// The same counters of each pod that counted any, by pod name.
    pub mismatches_by_pod: BTreeMap<String, crate::engines::integrity::Counts>,
    /// Pods whose counters grew and have not held still for the quiet window since: what grew
    /// (`tasks::counter_watch`), by pod name.
    pub integrity_violations: BTreeMap<String, Vec<String>>,
    /// Some pod of the deployment did not answer the last scrape (a promotion's baseline must
    /// cover every pod; a bake judges on whatever answered).
    pub mismatches_partial: bool,
    /// The spec's revision's integrity canary, once a run of it finished.
    pub canary: Option<CanaryStatus>,
    /// Pods of the deployment (any role) that cannot start.
    pub stuck: Vec<StuckPod>,
    /// Running pods this process has not read a report from yet: nothing is decided about
    /// them until it has (their reads wake the next pass).
    pub unread: Vec<String>,
    /// Serving pods the serving probes caught, with the reason and message their gate shows.
    pub probe_failures: crate::tasks::serving_probes::Failures,
    /// What the last sync of the InferencePool found (`None`: not synced by this process yet).
    pub inference_pool: Option<Option<PoolCondition>>,
}

impl World {
    /// Ready pods of the owned Deployment named `deployment_name` (0 when there is none).
    pub fn ready(&self, deployment_name: &str) -> i32 {
        self.deployments.iter().find(|d| d.name == deployment_name).map_or(0, |d| d.ready)
    }

    /// Where the deployment's KV-holding pods serve `/metrics` (their mismatch counters).
    pub fn counter_endpoints(&self, spec: &crate::crd::InferenceDeploymentSpec) -> Vec<Endpoint> {
        self.pods.iter().filter(|p| p.role.holds_kv()).filter_map(|p| Some((p.ip.clone()?, spec.port(p.role)))).collect()
    }

    pub fn pods_of<'w>(&'w self, revision: &'w str) -> impl Iterator<Item = &'w WorkerPod> + 'w {
        self.pods.iter().filter(move |p| p.revision == revision)
    }
}

/// The world of `d`, whose spec asks for `revision`, and the capacity reads that are due (the
/// pass starts them; observe starts nothing).
pub fn world(ctx: &Context, d: &InferenceDeployment, revision: &str) -> (World, Vec<Target>) {
    let ns = d.namespace().unwrap_or_default();
    let name = d.name_any();
    let uid = d.uid().unwrap_or_default();
    let owner = ObjectRef::from_obj(d);
    let ready = |dep: &k8s_openapi::api::apps::v1::Deployment| dep.status.as_ref().and_then(|s| s.ready_replicas).unwrap_or(0);
    let owned: Vec<_> = ctx
        .stores
        .deployments
        .state()
        .into_iter()
        .filter(|dep| dep.namespace().as_deref() == Some(&ns) && dep.metadata.deletion_timestamp.is_none())
        .filter(|dep| dep.owner_references().iter().any(|o| o.uid == uid))
        .collect();
    let router_name = router::router_name(d);
    let router_ready = owned.iter().find(|dep| dep.name_any() == router_name).map(|dep| ready(dep));
    let deployments = owned
        .iter()
        .filter_map(|dep| {
            let revision = dep.labels().get(labels::REVISION)?.clone();
            let image = cached::image(dep).map(str::to_owned);
            Some(OwnedDeployment { revision, ready: ready(dep), name: dep.name_any(), image })
        })
        .collect();

    let pods: Vec<_> = ctx.stores.pods.state().into_iter().filter(|p| belongs(p, &ns, &name, &uid)).collect();
    let stuck = pods
        .iter()
        .filter_map(|p| {
            let (reason, message) = pod_problems::cannot_start(p)?;
            Some(StuckPod { pod: p.name_any(), revision: p.labels().get(labels::REVISION).cloned(), reason, message })
        })
        .collect();
    let source = if d.spec.engine().integrity() { Source::Kvgate(ctx.root.deployment_key(&uid)) } else { Source::Engine(d.spec.engine) };
    let (mut unread, mut reads) = (Vec::new(), Vec::new());
    let workers: Vec<WorkerPod> = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| {
            let role = Role::from_component(p.labels().get(labels::COMPONENT)?).filter(|r| d.spec.roles().contains(r))?;
            let status = p.status.as_ref();
            let ip = status.and_then(|s| s.pod_ip.clone());
            let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
            let report = match &ip {
                // A router holds no KV: nothing to read; the gate judges it by its revision.
                _ if !role.holds_kv() => Err(NoReport::waiting(
                    "a router holds no KV: it passes the gate once its revision's prefill and decode pods have and its own containers are ready",
                )),
                _ if phase != "Running" => Err(NoReport::waiting(format!("the pod is {phase}, not Running"))),
                None => Err(NoReport::waiting("the pod has no IP yet")),
                Some(ip) => {
                    let target = Target {
                        pod_uid: p.uid().unwrap_or_default(),
                        pod: p.name_any(),
                        ip: ip.clone(),
                        port: d.spec.port(role),
                        restarts: restarts(p),
                        owner: owner.clone(),
                        owner_uid: uid.clone(),
                        source: source.clone(),
                    };
                    let (known, due) = ctx.probes.known(&target);
                    if due {
                        reads.push(target);
                    }
                    known.unwrap_or_else(|| {
                        unread.push(p.name_any());
                        Err(NoReport::waiting("reading the pod's capacity report"))
                    })
                }
            };
            let conditions = status.and_then(|s| s.conditions.as_deref()).unwrap_or_default();
            let condition = conditions.iter().find(|c| c.type_ == gate::CONDITION).cloned();
            let containers_ready = conditions.iter().any(|c| c.type_ == "ContainersReady" && c.status == "True");
            Some(WorkerPod {
                revision: p.labels().get(labels::REVISION).cloned().unwrap_or_default(),
                name: p.name_any(),
                role,
                ip,
                report,
                condition,
                containers_ready,
            })
        })
        .collect();

    let canary = ctx.canaries.result(&uid, revision);
    let probe_failures = d.status.as_ref().and_then(|s| s.current_revision.as_deref()).map(|s| ctx.serving_probes.failures(&uid, s)).unwrap_or_default();
    let inference_pool = ctx.memory.pool(d);
    let mut world = World {
        deployments,
        router_ready,
        pods: workers,
        mismatches: None,
        mismatches_by_pod: BTreeMap::new(),
        integrity_violations: BTreeMap::new(),
        mismatches_partial: false,
        canary,
        stuck,
        unread,
        probe_failures,
        inference_pool,
    };
    // The counters scraped for the last pass that asked (`decide` says when), for these pods.
    if let Some(c) = ctx.scrapes.latest(&uid, &world.counter_endpoints(&d.spec)) {
        (world.mismatches, world.mismatches_partial) = (Some(c.summed()), !c.complete);
        let name = |ip: &str| world.pods.iter().find(|p| p.ip.as_deref() == Some(ip)).map(|p| p.name.clone());
        world.mismatches_by_pod =
            c.by_pod.iter().filter(|(_, n)| crate::engines::integrity::total(n) > 0).filter_map(|((ip, _), n)| Some((name(ip)?, n.clone()))).collect();
        world.integrity_violations = c.violations.iter().filter_map(|((ip, _), grown)| Some((name(ip)?, grown.clone()))).collect();
    }
    (world, reads)
}

/// A pod of this deployment: its instance label, and (pods rendered since UIDs were labelled)
/// its deployment's UID, so the pods of a deleted namesake still terminating are not counted.
fn belongs(p: &Pod, ns: &str, name: &str, uid: &str) -> bool {
    p.namespace().as_deref() == Some(ns)
        && p.labels().get(labels::INSTANCE).map(String::as_str) == Some(name)
        && p.labels().get(labels::DEPLOYMENT_UID).is_none_or(|u| u == uid)
}

/// The worker container's restart count.
fn restarts(p: &Pod) -> i32 {
    p.status.as_ref().and_then(|s| s.container_statuses.as_ref()).and_then(|cs| cs.first()).map_or(0, |c| c.restart_count)
}
