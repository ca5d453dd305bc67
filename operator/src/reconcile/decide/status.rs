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

/// One pass's facts every condition is computed from.
struct Pass<'a> {
    d: &'a InferenceDeployment,
    o: &'a Observed,
    /// The spec's revision, refused.
    refused_now: Option<&'a RefusedRevision>,
    /// The spec's revision serves.
    rolled_out: bool,
    /// kvgate's router fronts every revision.
    kvgate: bool,
    /// A disaggregated engine: its router is one of its roles.
    split: bool,
}

/// A condition as computed: status, reason, message.
type Condition = (bool, Reason, String);

impl Pass<'_> {
    fn ready(&self, role: Role) -> i32 {
        self.o.ready.get(&role).copied().unwrap_or(0)
    }

    fn stuck(pods: &[String]) -> String {
        pods.join("; ")
    }

    /// The role's status, when the spec has the role.
    fn role(&self, role: Role, prev: &Option<RoleStatus>) -> Option<RoleStatus> {
        let (d, o) = (self.d, self.o);
        d.spec.roles().contains(&role).then(|| {
            // A refused revision is scaled to zero: keep what its pods measured.
            let kept = prev.as_ref().filter(|p| p.revision.as_deref() == Some(o.shown())).and_then(|p| p.min_measured_tokens);
            RoleStatus {
                revision: Some(o.shown().to_string()),
                desired_replicas: d.spec.replicas(role),
                ready_replicas: self.ready(role),
                verified_replicas: o.shown_pods.verified.get(&role).copied().unwrap_or(0),
                min_measured_tokens: o.shown_pods.min_measured.get(&role).copied().or(kept),
            }
        })
    }

    /// The router's status: a role of a disaggregated engine, kvgate's own router, or none.
    fn router(&self, prev: &Option<RoleStatus>) -> Option<RoleStatus> {
        if self.split {
            return self.role(Role::Router, prev);
        }
        self.kvgate.then_some(RoleStatus {
            revision: None,
            desired_replicas: self.d.spec.router.replicas,
            ready_replicas: self.o.router_ready,
            verified_replicas: 0,
            min_measured_tokens: None,
        })
    }

    /// The printer column `READY`: ready pods per role.
    fn ready_column(&self) -> String {
        match (self.kvgate, self.split) {
            (true, _) => format!("{}/{}/{}", self.o.router_ready, self.ready(Role::Prefill), self.ready(Role::Decode)),
            (false, true) => format!("{}/{}/{}", self.ready(Role::Router), self.ready(Role::Prefill), self.ready(Role::Decode)),
            (false, false) => self.ready(Role::Server).to_string(),
        }
    }

    /// `Available`: a verified revision serves with every role Ready.
    fn available(&self) -> Condition {
        let (d, o) = (self.d, self.o);
        let all_ready = d.spec.roles().iter().all(|&r| self.ready(r) > 0);
        let available = o.serving.is_some() && all_ready && (!self.kvgate || o.router_ready > 0);
        let counts = if self.kvgate {
            format!("{} router, {} prefill, {} decode pods ready", o.router_ready, self.ready(Role::Prefill), self.ready(Role::Decode))
        } else if self.split {
            let (router, prefill, decode) = (self.ready(Role::Router), self.ready(Role::Prefill), self.ready(Role::Decode));
            format!("{router} router, {prefill} prefill, {decode} decode {} pods ready", d.spec.engine.as_str())
        } else {
            format!("{} {} server pods ready", self.ready(Role::Server), d.spec.engine.as_str())
        };
        let serving_text = o.serving.as_ref().map_or("no revision has passed the rollout gate".to_string(), |s| {
            format!("revision {s} serves contextWindow {}: {counts}", o.serving_window.unwrap_or(0))
        });
        let (reason, message) = match (&o.serving, available, self.refused_now) {
            (_, true, _) => (Reason::Serving, serving_text),
            (None, _, Some(r)) => (Reason::RolloutRefused, format!("never available: {}", r.message)),
            (None, _, None) if !o.candidate_stuck.is_empty() => (Reason::PodsCannotStart, format!("never available: {}", Self::stuck(&o.candidate_stuck))),
            (None, _, None) => (Reason::AwaitingVerification, "the first revision's pods are not all verified and Ready yet".to_string()),
            (Some(_), false, _) if !o.router_stuck.is_empty() => (Reason::PodsCannotStart, format!("{serving_text}; {}", Self::stuck(&o.router_stuck))),
            (Some(_), false, _) => (Reason::NotEnoughReadyPods, serving_text),
        };
        (available, reason, message)
    }

    /// `Progressing`: the spec's revision is on its way (not serving, not refused).
    fn progressing(&self) -> Condition {
        let (d, o) = (self.d, self.o);
        let progressing = !self.rolled_out && self.refused_now.is_none();
        let (reason, message) = if let Some(r) = self.refused_now {
            (Reason::RolloutRefused, format!("revision {} refused; change the spec to try again", r.revision))
        } else if self.rolled_out {
            (Reason::RolloutComplete, format!("revision {} is serving", o.spec_revision))
        } else if !o.candidate_stuck.is_empty() {
            (Reason::PodsCannotStart, format!("revision {}: {}", o.spec_revision, Self::stuck(&o.candidate_stuck)))
        } else if o.canary_running {
            (
                Reason::IntegrityCanary,
                format!("revision {}: every pod's KV pool verified; the integrity canary runs before any pod takes traffic", o.spec_revision),
            )
        } else {
            let v = &o.candidate;
            let count = |r: &Role| format!("{}/{} {}", v.verified.get(r).copied().unwrap_or(0), d.spec.replicas(*r), r.as_str());
            let counts: Vec<String> = d.spec.roles().iter().map(count).collect();
            (Reason::VerifyingKVPools, format!("revision {}: {} pods verified", o.spec_revision, counts.join(" and ")))
        };
        (progressing, reason, message)
    }

    /// `CapacityVerified`: every pod of the spec's revision measured a pool holding the window.
    fn capacity_verified(&self) -> Condition {
        let (d, o) = (self.d, self.o);
        match (self.refused_now, &o.candidate.verdict, self.rolled_out) {
            (Some(r), _, _) => (false, Reason::Refused(r.reason), r.message.clone()),
            (None, _, true) => (
                true,
                Reason::KVPoolVerified,
                format!("every pod of revision {} measured a KV pool >= contextWindow {}", o.spec_revision, d.spec.context_window),
            ),
            (None, RevisionVerdict::Verified, false) => (
                true,
                Reason::KVPoolVerified,
                format!("every pod of revision {} measured a KV pool >= contextWindow {}; waiting for all to be Ready", o.spec_revision, d.spec.context_window),
            ),
            (None, _, false) => (false, Reason::AwaitingCapacityReports, format!("waiting for the capacity reports of revision {}", o.spec_revision)),
        }
    }

    /// `RolloutRefused`: the spec's revision stands refused, and why.
    fn rollout_refused(&self) -> Condition {
        match self.refused_now {
            Some(r) => (true, Reason::Refused(r.reason), format!("revision {}: {}", r.revision, r.message)),
            None => (false, Reason::NotRefused, String::new()),
        }
    }

    /// `Degraded`: a pod of the serving revision no longer passes the gate, cannot start, or
    /// counted handoff mismatches.
    fn degraded(&self) -> Condition {
        let o = self.o;
        let degraded = o.serving.is_some() && !(o.unverified.is_empty() && o.serving_stuck.is_empty() && o.integrity.is_empty());
        let found = |s: &str| degraded_message(s, &o.unverified, &o.serving_stuck, &o.integrity);
        let (reason, message) = match &o.serving {
            Some(s) if !o.unverified.is_empty() => (Reason::ServingPodUnverified, found(s)),
            Some(s) if !o.serving_stuck.is_empty() => (Reason::PodsCannotStart, found(s)),
            Some(s) if !o.integrity.is_empty() => (Reason::HandoffMismatchesCounted, found(s)),
            Some(s) => (Reason::ServingPodsVerified, format!("every pod of serving revision {s} passes the gate")),
            None => (Reason::NoServingRevision, "no revision serves yet".to_string()),
        };
        (degraded, reason, message)
    }

    /// The phase, from the conditions computed above.
    fn phase(&self, available: bool, degraded: bool) -> Phase {
        match self.refused_now {
            Some(r) if r.rolled_back => Phase::RolledBack,
            Some(_) => Phase::Refused,
            None if self.o.bake.is_some() && self.rolled_out => Phase::Baking,
            // Serving, with a serving pod out of the Service (all of a role's, even), or one whose
            // integrity counters grew.
            None if self.rolled_out && degraded => Phase::Degraded,
            None if self.rolled_out && available => Phase::Available,
            None if self.o.canary_running => Phase::Canary,
            None => Phase::Progressing,
        }
    }

    /// One word for the printer column: what explains the phase.
    fn phase_reason(&self, phase: Phase, available: Reason, progressing: Reason, degraded: Reason) -> Option<String> {
        match phase {
            Phase::Refused | Phase::RolledBack => self.refused_now.map(|r| r.reason.as_str().to_string()),
            Phase::Degraded => Some(degraded.as_str().to_string()),
            // The spec's revision serves but is not all Ready: Available's reason says why.
            Phase::Progressing if self.rolled_out => Some(available.as_str().to_string()),
            Phase::Progressing | Phase::Canary => Some(progressing.as_str().to_string()),
            Phase::Baking | Phase::Available => None,
        }
    }
}

pub fn compute(d: &InferenceDeployment, prev: &InferenceDeploymentStatus, o: &Observed) -> InferenceDeploymentStatus {
    let generation = d.metadata.generation;
    let refused_now = o.refused.as_ref().filter(|r| r.revision == o.spec_revision);
    let pass = Pass {
        d,
        o,
        refused_now,
        rolled_out: o.serving.as_ref() == Some(&o.spec_revision),
        kvgate: d.spec.engine().integrity(),
        split: d.spec.roles().contains(&Role::Router),
    };
    let (prefill, decode, server) = (pass.role(Role::Prefill, &prev.prefill), pass.role(Role::Decode, &prev.decode), pass.role(Role::Server, &prev.server));

    let mut conds = prev.conditions.clone();
    let mut set = |type_, (ok, reason, message): Condition| conditions::set(&mut conds, type_, ok, reason, message, generation, &o.now);
    let available = pass.available();
    let progressing = pass.progressing();
    let degraded = pass.degraded();
    let (is_available, available_reason) = (available.0, available.1);
    let (progressing_reason, (is_degraded, degraded_reason)) = (progressing.1, (degraded.0, degraded.1));
    set(AVAILABLE, available);
    set(PROGRESSING, progressing);
    set(CAPACITY_VERIFIED, pass.capacity_verified());
    set(ROLLOUT_REFUSED, pass.rollout_refused());
    set(DEGRADED, degraded);
    if let Some(p) = &o.shown_pods.slowest_prefill {
        set(PREFILL_WITHIN_DEADLINE, prefill_deadline(p, d.spec.context_window, d.spec.handoff.timeout_ms));
    }
    match &o.inference_pool {
        // Not synced by this process yet: the condition stands as the last pass wrote it.
        None => {}
        Some(None) => conds.retain(|c| c.type_ != inference_pool::CONDITION),
        Some(Some(p)) => set(inference_pool::CONDITION, (p.ok, p.reason, p.message.clone())),
    }

    let phase = pass.phase(is_available, is_degraded);
    InferenceDeploymentStatus {
        observed_generation: generation,
        phase: Some(phase),
        reason: pass.phase_reason(phase, available_reason, progressing_reason, degraded_reason),
        ready: Some(pass.ready_column()),
        conditions: conds,
        current_revision: o.serving.clone(),
        current_context_window: o.serving_window,
        candidate_revision: (!pass.rolled_out && refused_now.is_none()).then(|| o.spec_revision.clone()),
        refused_revision: o.refused.clone(),
        canary: o.canary.clone(),
        bake: o.bake.clone(),
        min_measured_tokens: [&prefill, &decode, &server].into_iter().flatten().filter_map(|r| r.min_measured_tokens).min(),
        // Written with the pass that created it (the create comes first; a failed one writes
        // no status).
        handoff_secret: d.spec.handoff_secret().then(|| crate::render::secret::secret_name(d)),
        router: pass.router(&prev.router),
        prefill,
        decode,
        server,
    }
}
