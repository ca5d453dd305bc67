//! Observe: everything one reconcile reads, and nothing it writes. The object itself (re-read,
//! not the watch cache), the Deployments it owns, and the pods of its workers with their
//! capacity reports (verified with the deployment's handoff secret) and gate conditions.

use futures::future::join_all;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, PodCondition, Secret};
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use kvgate_proto::CapacityReport;
use kvgate_proto::auth::DeploymentKey;

use super::{Context, Error};
use crate::crd::InferenceDeployment;
use crate::gate::{self, Role};
use crate::render::{labels, router, secret};
use crate::scrape;

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
    /// The pod's verified capacity report, or why there is none.
    pub report: Result<CapacityReport, NoReport>,
    pub condition: Option<PodCondition>,
}

/// Why a pod has no report: not running yet, unreachable, not a report, or one that does not
/// verify as this pod's (`reason` is the gate condition's).
#[derive(Debug, Clone, PartialEq)]
pub struct NoReport {
    pub reason: &'static str,
    pub message: String,
}

impl NoReport {
    pub fn waiting(message: impl Into<String>) -> Self {
        NoReport { reason: "AwaitingCapacityReport", message: message.into() }
    }
}

/// The world as one reconcile found it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct World {
    pub deployments: Vec<OwnedDeployment>,
    /// Ready pods of the router Deployment (`None`: there is none).
    pub router_ready: Option<i32>,
    pub pods: Vec<WorkerPod>,
    /// The deployment's worker pods' `kvgate_handoff_mismatch_total`, summed by reason; read
    /// only while a promotion or a bake may need it.
    pub mismatches: Option<std::collections::BTreeMap<String, u64>>,
}

impl World {
    /// Ready pods of the owned Deployment named `deployment_name` (0 when there is none).
    pub fn ready(&self, deployment_name: &str) -> i32 {
        self.deployments.iter().find(|d| d.name == deployment_name).map_or(0, |d| d.ready)
    }

    pub fn pods_of<'w>(&'w self, revision: &'w str) -> impl Iterator<Item = &'w WorkerPod> + 'w {
        self.pods.iter().filter(move |p| p.revision == revision)
    }
}

/// The object as it is now: the watch cache may lag our own last status write, and decisions
/// (refuse once, promote once) are taken on what is stored.
pub async fn object(ctx: &Context, ns: &str, name: &str) -> Result<Option<InferenceDeployment>, Error> {
    let api: Api<InferenceDeployment> = Api::namespaced(ctx.client.clone(), ns);
    api.get_opt(name).await.map_err(Error::api(format!("reading InferenceDeployment {name}")))
}

/// The world, and the deployment's handoff key (or why there is none), which verified the
/// reports and which the canary signs with.
pub async fn world(ctx: &Context, d: &InferenceDeployment) -> Result<(World, Result<DeploymentKey, String>), Error> {
    let ns = d.namespace().unwrap_or_else(|| "default".into());
    let name = d.name_any();
    // One list of the instance's Deployments: the workers' (one per revision) and the router's.
    let instance = ListParams::default().labels(&format!("{}={name}", labels::INSTANCE));
    let deployments_api: Api<Deployment> = Api::namespaced(ctx.client.clone(), &ns);
    let listed = deployments_api.list(&instance).await.map_err(Error::api("listing Deployments"))?;
    let ready = |dep: &Deployment| dep.status.as_ref().and_then(|s| s.ready_replicas).unwrap_or(0);
    let router_name = router::router_name(d);
    let router_ready = listed.iter().find(|dep| dep.name_any() == router_name).map(ready);
    let deployments = listed
        .iter()
        .filter_map(|dep| {
            let revision = dep.labels().get(labels::REVISION)?.clone();
            let image = dep.spec.template.spec.as_ref().and_then(|s| s.containers.first()).and_then(|c| c.image.clone());
            Some(OwnedDeployment { revision, ready: ready(dep), name: dep.name_any(), image })
        })
        .collect();
    let mine = ListParams::default().labels(&format!("{}={name},{}", labels::INSTANCE, labels::REVISION));

    let key = handoff_key(ctx, d, &ns).await;
    let pods_api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let listed = pods_api.list(&mine).await.map_err(Error::api("listing pods"))?;
    let workers: Vec<(Role, Pod)> = listed
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| {
            let role = match p.labels().get(labels::COMPONENT).map(String::as_str) {
                Some("prefill") => Role::Prefill,
                Some("decode") => Role::Decode,
                _ => return None,
            };
            Some((role, p))
        })
        .collect();
    let key = &key;
    let pods = join_all(workers.into_iter().map(|(role, pod)| async move {
        let report = match key {
            Ok(key) => report(ctx, role, &pod, key).await,
            Err(why) => Err(NoReport::waiting(why.clone())),
        };
        let condition = pod.status.as_ref().and_then(|s| s.conditions.as_ref()).and_then(|cs| cs.iter().find(|c| c.type_ == gate::CONDITION)).cloned();
        let ip = pod.status.as_ref().and_then(|s| s.pod_ip.clone());
        WorkerPod { revision: pod.labels().get(labels::REVISION).cloned().unwrap_or_default(), name: pod.name_any(), role, ip, report, condition }
    }))
    .await;
    // The mismatch counters matter when a promotion (the bake's baseline) or a bake may happen.
    let status = d.status.clone().unwrap_or_default();
    let promotable = status.canary.as_ref().is_some_and(|c| c.passed && status.current_revision.as_ref() != Some(&c.revision));
    let mismatches = if status.bake.is_some() || promotable || d.spec.rollout.canary.prompts == 0 { mismatches(ctx, &pods).await } else { None };
    Ok((World { deployments, router_ready, pods, mismatches }, key.clone()))
}

/// Every running worker pod's handoff mismatch counters, summed by reason (`None` when none
/// answered).
async fn mismatches(ctx: &Context, pods: &[WorkerPod]) -> Option<std::collections::BTreeMap<String, u64>> {
    let reads = join_all(pods.iter().filter_map(|p| Some((p.ip.as_deref()?, p.role.port()))).map(|(ip, port)| scrape::metrics(&ctx.http, ip, port))).await;
    let mut total = std::collections::BTreeMap::new();
    let mut any = false;
    for text in reads.into_iter().flatten() {
        any = true;
        for (reason, n) in scrape::family_by(&text, scrape::MISMATCHES, "reason") {
            *total.entry(reason).or_insert(0) += n as u64;
        }
    }
    any.then_some(total)
}

/// The deployment's handoff secret as MAC keys; without it no report can be verified.
async fn handoff_key(ctx: &Context, d: &InferenceDeployment, ns: &str) -> Result<DeploymentKey, String> {
    let name = secret::secret_name(d);
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let found = api.get_opt(&name).await.map_err(|e| format!("reading the handoff Secret {name}: {e}"))?;
    let bytes = found
        .and_then(|s| s.data)
        .and_then(|mut data| data.remove(secret::KEY))
        .ok_or_else(|| format!("the handoff Secret {name} (key `{}`) does not exist yet, so no report can be verified", secret::KEY))?;
    // A secret the workers would trim (`echo > file`) is the same secret here.
    DeploymentKey::new(bytes.0.trim_ascii_end()).map_err(|e| format!("the handoff Secret {name}: {e}"))
}

async fn report(ctx: &Context, role: Role, pod: &Pod, key: &DeploymentKey) -> Result<CapacityReport, NoReport> {
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
    if phase != "Running" {
        return Err(NoReport::waiting(format!("the pod is {phase}, not Running")));
    }
    let ip = status.and_then(|s| s.pod_ip.as_deref()).ok_or_else(|| NoReport::waiting("the pod has no IP yet"))?;
    crate::capacity::read(&ctx.http, ip, role.port(), &pod.name_any(), key).await.map_err(|e| NoReport { reason: e.reason(), message: e.to_string() })
}
