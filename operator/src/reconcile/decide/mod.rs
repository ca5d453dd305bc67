//! Decide: from what one reconcile observed, the whole plan of what to write. Pure: no I/O, no
//! clock, so every transition of the rollout is a table test.
//!
//! Revisions: the serving one (`status.currentRevision`, verified) and the one the spec asks for.
//! When they differ, the spec's revision is the candidate: its own Deployments come up next to
//! the serving ones, which are never touched. Candidate pods carry the readiness gate, so until
//! they are verified (and, with the canary on, until it passed) they are not Ready and no
//! Service routes to them. A verified candidate at full strength is promoted; a failing one is
//! refused: scaled to zero, recorded in status, announced and counted once, never retried until
//! the spec changes.
//!
//! One pass is a pipeline of named steps, each in its own file with its own table tests, each
//! advancing one [`Rollout`]:
//!
//! 1. `candidate` — judge the spec's revision: refuse it, hold it for the canary, or promote it;
//! 2. `canary` — record a finished canary, or ask for one to run;
//! 3. `bake` — start a bake at a promotion, judge it on every pass after;
//! 4. `workloads` — the Deployments each revision should have, those to delete, the router;
//! 5. `gates` — the readiness-gate condition every pod should carry, and what serving pods fail;
//! 6. `status` — the status and conditions that say all of it.

mod bake;
mod canary;
mod candidate;
mod gates;
mod status;
mod workloads;

#[cfg(test)]
mod tests;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::inference_pool::CONDITION as POOL_CONDITION;
use super::observe::World;
use crate::canary::CanaryRun;
use crate::crd::{BakeStatus, CanaryStatus, InferenceDeployment, InferenceDeploymentStatus, RefusedRevision};
use crate::gate::PodVerdict;
use crate::reasons::{EventAction, Reason};
use crate::rollout_state::{RefusalReason, RollbackReason};
use status::Observed;

pub use gates::{PodGate, PrefillEstimate, Verification};
pub use workloads::WorkerDeployment;

/// An Event to publish on the InferenceDeployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announcement {
    pub warning: bool,
    pub reason: Reason,
    pub action: EventAction,
    pub note: String,
}

pub(crate) fn warning(reason: Reason, action: EventAction, note: String) -> Announcement {
    Announcement { warning: true, reason, action, note }
}

pub(crate) fn normal(reason: Reason, action: EventAction, note: String) -> Announcement {
    Announcement { warning: false, reason, action, note }
}

/// Everything one reconcile writes.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The spec's revision's Deployments (none when its pods may not be created at all).
    pub workers: Vec<WorkerDeployment>,
    /// Deployments of revisions that neither serve, bake nor are the candidate.
    pub delete: Vec<String>,
    /// The router Deployment, admitting this window; `None`: leave it as it is.
    pub router_window: Option<u64>,
    /// The image the router runs: the serving revision's (`None` before one serves: the
    /// spec's). An image no revision has proven never fronts traffic.
    pub router_image: Option<String>,
    pub pod_gates: Vec<PodGate>,
    pub events: Vec<Announcement>,
    /// A refusal decided now: counted once under this reason.
    pub refused_reason: Option<RefusalReason>,
    pub status: InferenceDeploymentStatus,
    /// Nothing is in flight: the spec's revision serves or stands refused.
    pub settled: bool,
    /// The integrity canary that should be running (started once per revision, in the
    /// background; its result is a later pass's input).
    pub canary: Option<CanaryRun>,
    /// The probes that should run on the serving revision's pods, at their rate.
    pub serving_probe: Option<crate::canary::ServingRun>,
    /// Why each pod of the serving revision that no longer passes the gate fails it.
    pub unverified: Vec<String>,
    /// A rollback decided now: counted once under this reason.
    pub rollback: Option<RollbackReason>,
    /// The worker pods whose integrity counters are scraped after this pass, and how
    /// (`None`: none).
    pub scrape: Option<(Vec<crate::tasks::scrapes::Endpoint>, crate::tasks::scrapes::Pace)>,
    /// A pod cannot find the deployment's handoff Secret (someone deleted it): create it again.
    pub recreate_secret: bool,
}

/// What `decide` needs besides the observed world.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    pub d: &'a InferenceDeployment,
    /// The revision the spec asks for.
    pub revision: &'a str,
    /// Why the spec's pods may not be created at all (a node directory that is not allowed).
    pub host_path_refusal: Option<&'a str>,
    pub world: &'a World,
    /// The time of this pass (bakes are timed against it).
    pub now: &'a Time,
}

impl Inputs<'_> {
    fn window(&self) -> u64 {
        self.d.spec.context_window
    }
}

/// The rollout as the steps advance it through one pass; starts as the last status left it.
#[derive(Debug, Clone, PartialEq)]
struct Rollout {
    /// The serving revision and the window it was verified for.
    serving: Option<String>,
    serving_window: Option<u64>,
    refused: Option<RefusedRevision>,
    /// A refusal decided in this pass.
    refused_now: Option<RefusalReason>,
    rollback: Option<RollbackReason>,
    /// The spec's revision runs no pods (it stands refused).
    scale_to_zero: bool,
    bake: Option<BakeStatus>,
    /// `status.canary` after this pass.
    canary: Option<CanaryStatus>,
    /// The canary that should run now.
    canary_run: Option<CanaryRun>,
    /// The candidate's verified pods are held out of traffic until its canary passed.
    canary_pending: bool,
    events: Vec<Announcement>,
}

impl Rollout {
    fn from_status(prev: &InferenceDeploymentStatus) -> Self {
        Rollout {
            serving: prev.current_revision.clone(),
            serving_window: prev.current_context_window,
            refused: prev.refused_revision.clone(),
            refused_now: None,
            rollback: None,
            scale_to_zero: false,
            bake: prev.bake.clone(),
            canary: prev.canary.clone(),
            canary_run: None,
            canary_pending: false,
            events: Vec::new(),
        }
    }

    /// The spec's revision stands refused (before this pass or now).
    fn refused(&self, rev: &str) -> bool {
        self.refused.as_ref().is_some_and(|r| r.revision == rev)
    }

    /// Records a refusal decided now: kept in status, counted once.
    fn refuse(&mut self, rev: &str, reason: RefusalReason, message: &str) {
        self.refused = Some(RefusedRevision { revision: rev.into(), reason, message: message.into(), rolled_back: false });
        self.refused_now = Some(reason);
    }

    /// Records a rollback of `rev`, which served: refused for the same reason, marked rolled
    /// back (phase RolledBack), counted once as a rollback.
    fn roll_back(&mut self, rev: &str, reason: RollbackReason, message: &str) {
        self.refuse(rev, reason.into(), message);
        self.refused.as_mut().expect("refuse sets it").rolled_back = true;
        self.rollback = Some(reason);
    }
}

pub fn decide(i: Inputs<'_>) -> Plan {
    let prev = i.d.status.clone().unwrap_or_default();
    let mut r = Rollout::from_status(&prev);
    let (candidate, candidate_verdicts) = gates::verify(i.world, i.revision, i.window());
    canary::record(&i, &mut r);
    candidate::judge(&i, &candidate, &mut r);
    bake::advance(&i, &prev, &mut r);
    let workloads = workloads::plan(&i, &r);
    let gates = gates::plan(&i, &prev, &r, &candidate_verdicts);
    r.events.extend(gates.events);

    let shown = r.serving.clone().unwrap_or_else(|| i.revision.to_string());
    let stuck = |rev: &str| i.world.stuck.iter().filter(|s| s.revision.as_deref() == Some(rev)).map(|s| s.describe()).collect::<Vec<_>>();
    let observed = Observed {
        now: i.now.clone(),
        inference_pool: i.world.inference_pool.clone(),
        spec_revision: i.revision.to_string(),
        serving: r.serving.clone(),
        serving_window: r.serving_window,
        refused: r.refused.clone(),
        candidate,
        shown_pods: gates.shown,
        ready: i.d.spec.roles().iter().map(|&role| (role, i.world.ready(&crate::render::workers::deployment_name(i.d, role, &shown)))).collect(),
        router_ready: i.world.router_ready.unwrap_or(0),
        canary_running: r.canary_run.is_some(),
        canary: r.canary.clone(),
        unverified: gates.unverified.clone(),
        integrity: gates.integrity.clone(),
        candidate_stuck: if r.refused(i.revision) { Vec::new() } else { stuck(i.revision) },
        serving_stuck: r.serving.as_deref().map(stuck).unwrap_or_default(),
        router_stuck: i.world.stuck.iter().filter(|s| s.revision.is_none()).map(|s| s.describe()).collect(),
        bake: r.bake.clone(),
    };
    let status = status::compute(i.d, &prev, &observed);
    r.events.extend(pool_event(&prev, &status, &observed));
    let settled = (r.serving.as_deref() == Some(i.revision) && r.bake.is_none()) || r.refused(i.revision);
    let serving_probe = canary::serving(&i, &r);
    let scrape = bake::counters_wanted(&i, &r).map(|pace| (i.world.counter_endpoints(&i.d.spec), pace));
    Plan {
        workers: workloads.workers,
        delete: workloads.delete,
        router_window: workloads.router_window,
        router_image: workloads.router_image,
        pod_gates: gates.pod_gates,
        events: r.events,
        refused_reason: r.refused_now,
        status,
        settled,
        serving_probe,
        canary: r.canary_run,
        unverified: gates.unverified,
        rollback: r.rollback,
        scrape,
        recreate_secret: secret_missing(&i),
    }
}

/// A pod cannot find the deployment's own handoff Secret (someone deleted it).
fn secret_missing(i: &Inputs<'_>) -> bool {
    let secret = crate::render::secret::secret_name(i.d);
    i.d.spec.handoff_secret() && i.world.stuck.iter().any(|s| s.missing_secret() == Some(secret.as_str()))
}

/// The Event of an InferencePool condition whose status changed.
fn pool_event(prev: &InferenceDeploymentStatus, now: &InferenceDeploymentStatus, o: &Observed) -> Option<Announcement> {
    let status = |s: &InferenceDeploymentStatus| s.conditions.iter().find(|c| c.type_ == POOL_CONDITION).map(|c| c.status.clone());
    let found = o.inference_pool.as_ref()?.as_ref()?;
    (status(prev) != status(now)).then(|| Announcement {
        warning: !found.ok,
        reason: found.reason,
        action: EventAction::InferencePool,
        note: found.message.clone(),
    })
}

/// Whether every desired pod of every role exists and passed the pool check.
fn all_pods(d: &InferenceDeployment, v: &Verification) -> bool {
    d.spec.roles().iter().all(|&r| {
        let want = d.spec.replicas(r);
        want > 0 && v.pods.get(&r).copied().unwrap_or(0) == want && v.verified.get(&r).copied().unwrap_or(0) == want
    })
}

/// The messages of every pod verdict that failed.
fn failures(verdicts: &[PodVerdict]) -> Vec<String> {
    verdicts
        .iter()
        .filter_map(|v| match v {
            PodVerdict::Failed { message, .. } => Some(message.clone()),
            _ => None,
        })
        .collect()
}
