//! Step 6: the status an InferenceDeployment gets from what one reconcile observed and decided. Pure.
//! It says only what was observed: a canary runs only once every pod was verified, and a pod
//! that cannot start is named with its own reason and message.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::conditions::{self, AVAILABLE, CAPACITY_VERIFIED, DEGRADED, PREFILL_WITHIN_DEADLINE, PROGRESSING, ROLLOUT_REFUSED};
use crate::crd::{BakeStatus, CanaryStatus, InferenceDeployment, InferenceDeploymentStatus, RefusedRevision, RoleStatus};
use crate::gate::{RevisionVerdict, Role};
use crate::rollout_state::Phase;

use crate::reconcile::inference_pool::{self, PoolCondition};

use super::gates::{Verification, degraded_message, prefill_deadline};
use crate::reasons::Reason;

/// What the reconcile saw and decided.
#[derive(Debug, Clone)]
pub struct Observed {
    /// The pass's time: a condition whose status changes changes at it.
    pub now: Time,
    /// What the last InferencePool sync found (`None`: not synced by this process yet).
    pub inference_pool: Option<Option<PoolCondition>>,
    /// The revision the spec asks for.
    pub spec_revision: String,
    /// The verified revision that serves, if any.
    pub serving: Option<String>,
    pub serving_window: Option<u64>,
    pub refused: Option<RefusedRevision>,
    /// The gate's findings on the spec's revision.
    pub candidate: Verification,
    /// The pods of the revision the role counts describe: `shown()`.
    pub shown_pods: Verification,
    /// Ready pods of `shown()`, per role.
    pub ready: BTreeMap<Role, i32>,
    pub router_ready: i32,
    /// Every pod of the candidate is verified and its integrity canary runs.
    pub canary_running: bool,
    /// `status.canary` after this pass.
    pub canary: Option<CanaryStatus>,
    /// Why each serving pod that no longer passes the gate fails it.
    pub unverified: Vec<String>,
    /// Each serving pod whose integrity counters grew.
    pub integrity: Vec<String>,
    /// Pods that cannot start, described with their own reason and message: the candidate's,
    /// the serving revision's, the router's.
    pub candidate_stuck: Vec<String>,
    pub serving_stuck: Vec<String>,
    pub router_stuck: Vec<String>,
    /// The bake in progress after this pass.
    pub bake: Option<BakeStatus>,
}

impl Observed {
    /// The revision status describes: the serving one, else (before the first) the spec's.
    pub fn shown(&self) -> &str {
        self.serving.as_deref().unwrap_or(&self.spec_revision)
    }
}

pub fn compute(d: &InferenceDeployment, prev: &InferenceDeploymentStatus, o: &Observed) -> InferenceDeploymentStatus {
    let generation = d.metadata.generation;
    let refused_now = o.refused.as_ref().filter(|r| r.revision == o.spec_revision);
    let rolled_out = o.serving.as_ref() == Some(&o.spec_revision);
    // kvgate's router fronts every revision; a disaggregated engine's is one of its roles.
    let kvgate = d.spec.engine().integrity();
    let split = d.spec.roles().contains(&Role::Router);
    let ready = |role: Role| o.ready.get(&role).copied().unwrap_or(0);
    let role = |role: Role, prev: &Option<RoleStatus>| -> Option<RoleStatus> {
        d.spec.roles().contains(&role).then(|| {
            // A refused revision is scaled to zero: keep what its pods measured.
            let kept = prev.as_ref().filter(|p| p.revision.as_deref() == Some(o.shown())).and_then(|p| p.min_measured_tokens);
            RoleStatus {
                revision: Some(o.shown().to_string()),
                desired_replicas: d.spec.replicas(role),
                ready_replicas: ready(role),
                verified_replicas: o.shown_pods.verified.get(&role).copied().unwrap_or(0),
                min_measured_tokens: o.shown_pods.min_measured.get(&role).copied().or(kept),
            }
        })
    };
    let (prefill, decode, server) = (role(Role::Prefill, &prev.prefill), role(Role::Decode, &prev.decode), role(Role::Server, &prev.server));
    let router = if split {
        role(Role::Router, &prev.router)
    } else {
        kvgate.then_some(RoleStatus {
            revision: None,
            desired_replicas: d.spec.router.replicas,
            ready_replicas: o.router_ready,
            verified_replicas: 0,
            min_measured_tokens: None,
        })
    };
    let stuck = |pods: &[String]| pods.join("; ");

    let mut conds = prev.conditions.clone();
    let all_ready = d.spec.roles().iter().all(|&r| ready(r) > 0);
    let available = o.serving.is_some() && all_ready && (!kvgate || o.router_ready > 0);
    let counts = if kvgate {
        format!("{} router, {} prefill, {} decode pods ready", o.router_ready, ready(Role::Prefill), ready(Role::Decode))
    } else if split {
        format!("{} router, {} prefill, {} decode {} pods ready", ready(Role::Router), ready(Role::Prefill), ready(Role::Decode), d.spec.engine.as_str())
    } else {
        format!("{} {} server pods ready", ready(Role::Server), d.spec.engine.as_str())
    };
    let serving_text = o.serving.as_ref().map_or("no revision has passed the rollout gate".to_string(), |s| {
        format!("revision {s} serves contextWindow {}: {counts}", o.serving_window.unwrap_or(0))
    });
    let (available_reason, message) = match (&o.serving, available, refused_now) {
        (_, true, _) => (Reason::Serving, serving_text.clone()),
        (None, _, Some(r)) => (Reason::RolloutRefused, format!("never available: {}", r.message)),
        (None, _, None) if !o.candidate_stuck.is_empty() => (Reason::PodsCannotStart, format!("never available: {}", stuck(&o.candidate_stuck))),
        (None, _, None) => (Reason::AwaitingVerification, "the first revision's pods are not all verified and Ready yet".to_string()),
        (Some(_), false, _) if !o.router_stuck.is_empty() => (Reason::PodsCannotStart, format!("{serving_text}; {}", stuck(&o.router_stuck))),
        (Some(_), false, _) => (Reason::NotEnoughReadyPods, serving_text.clone()),
    };
    conditions::set(&mut conds, AVAILABLE, available, available_reason, message, generation, &o.now);

    let progressing = !rolled_out && refused_now.is_none();
    let (progressing_reason, message) = if let Some(r) = refused_now {
        (Reason::RolloutRefused, format!("revision {} refused; change the spec to try again", r.revision))
    } else if rolled_out {
        (Reason::RolloutComplete, format!("revision {} is serving", o.spec_revision))
    } else if !o.candidate_stuck.is_empty() {
        (Reason::PodsCannotStart, format!("revision {}: {}", o.spec_revision, stuck(&o.candidate_stuck)))
    } else if o.canary_running {
        (Reason::IntegrityCanary, format!("revision {}: every pod's KV pool verified; the integrity canary runs before any pod takes traffic", o.spec_revision))
    } else {
        let v = &o.candidate;
        let count = |r: &Role| format!("{}/{} {}", v.verified.get(r).copied().unwrap_or(0), d.spec.replicas(*r), r.as_str());
        let counts: Vec<String> = d.spec.roles().iter().map(count).collect();
        (Reason::VerifyingKVPools, format!("revision {}: {} pods verified", o.spec_revision, counts.join(" and ")))
    };
    conditions::set(&mut conds, PROGRESSING, progressing, progressing_reason, message, generation, &o.now);

    let (ok, reason, message) = match (refused_now, &o.candidate.verdict, rolled_out) {
        (Some(r), _, _) => (false, Reason::Refused(r.reason), r.message.clone()),
        (None, _, true) => {
            (true, Reason::KVPoolVerified, format!("every pod of revision {} measured a KV pool >= contextWindow {}", o.spec_revision, d.spec.context_window))
        }
        (None, RevisionVerdict::Verified, false) => (
            true,
            Reason::KVPoolVerified,
            format!("every pod of revision {} measured a KV pool >= contextWindow {}; waiting for all to be Ready", o.spec_revision, d.spec.context_window),
        ),
        (None, _, false) => (false, Reason::AwaitingCapacityReports, format!("waiting for the capacity reports of revision {}", o.spec_revision)),
    };
    conditions::set(&mut conds, CAPACITY_VERIFIED, ok, reason, message, generation, &o.now);

    let (reason, message) = match refused_now {
        Some(r) => (Reason::Refused(r.reason), format!("revision {}: {}", r.revision, r.message)),
        None => (Reason::NotRefused, String::new()),
    };
    conditions::set(&mut conds, ROLLOUT_REFUSED, refused_now.is_some(), reason, message, generation, &o.now);

    let degraded = o.serving.is_some() && !(o.unverified.is_empty() && o.serving_stuck.is_empty() && o.integrity.is_empty());
    let found = |s: &str| degraded_message(s, &o.unverified, &o.serving_stuck, &o.integrity);
    let (degraded_reason, message) = match &o.serving {
        Some(s) if !o.unverified.is_empty() => (Reason::ServingPodUnverified, found(s)),
        Some(s) if !o.serving_stuck.is_empty() => (Reason::PodsCannotStart, found(s)),
        Some(s) if !o.integrity.is_empty() => (Reason::HandoffMismatchesCounted, found(s)),
        Some(s) => (Reason::ServingPodsVerified, format!("every pod of serving revision {s} passes the gate")),
        None => (Reason::NoServingRevision, "no revision serves yet".to_string()),
    };
    conditions::set(&mut conds, DEGRADED, degraded, degraded_reason, message, generation, &o.now);

    if let Some(p) = &o.shown_pods.slowest_prefill {
        let (ok, reason, message) = prefill_deadline(p, d.spec.context_window, d.spec.handoff.timeout_ms);
        conditions::set(&mut conds, PREFILL_WITHIN_DEADLINE, ok, reason, message, generation, &o.now);
    }

    match &o.inference_pool {
        // Not synced by this process yet: the condition stands as the last pass wrote it.
        None => {}
        Some(None) => conds.retain(|c| c.type_ != inference_pool::CONDITION),
        Some(Some(p)) => conditions::set(&mut conds, inference_pool::CONDITION, p.ok, p.reason, p.message.clone(), generation, &o.now),
    }

    let phase = match refused_now {
        Some(r) if r.rolled_back => Phase::RolledBack,
        Some(_) => Phase::Refused,
        None if o.bake.is_some() && rolled_out => Phase::Baking,
        // Serving, with a serving pod out of the Service (all of a role's, even), or one whose
        // integrity counters grew.
        None if rolled_out && degraded => Phase::Degraded,
        None if rolled_out && available => Phase::Available,
        None if o.canary_running => Phase::Canary,
        None => Phase::Progressing,
    };
    // One word for the printer column: what explains the phase.
    let reason = match phase {
        Phase::Refused | Phase::RolledBack => refused_now.map(|r| r.reason.as_str().to_string()),
        Phase::Degraded => Some(degraded_reason.as_str().to_string()),
        // The spec's revision serves but is not all Ready: Available's reason says why.
        Phase::Progressing if rolled_out => Some(available_reason.as_str().to_string()),
        Phase::Progressing | Phase::Canary => Some(progressing_reason.as_str().to_string()),
        Phase::Baking | Phase::Available => None,
    };
    InferenceDeploymentStatus {
        observed_generation: generation,
        phase: Some(phase),
        reason,
        ready: Some(match (kvgate, split) {
            (true, _) => format!("{}/{}/{}", o.router_ready, ready(Role::Prefill), ready(Role::Decode)),
            (false, true) => format!("{}/{}/{}", ready(Role::Router), ready(Role::Prefill), ready(Role::Decode)),
            (false, false) => ready(Role::Server).to_string(),
        }),
        conditions: conds,
        current_revision: o.serving.clone(),
        current_context_window: o.serving_window,
        candidate_revision: (!rolled_out && refused_now.is_none()).then(|| o.spec_revision.clone()),
        refused_revision: o.refused.clone(),
        canary: o.canary.clone(),
        bake: o.bake.clone(),
        min_measured_tokens: [&prefill, &decode, &server].into_iter().flatten().filter_map(|r| r.min_measured_tokens).min(),
        // Written with the pass that created it (the create comes first; a failed one writes
        // no status).
        handoff_secret: d.spec.handoff_secret().then(|| crate::render::secret::secret_name(d)),
        prefill,
        decode,
        router,
        server,
    }
}
