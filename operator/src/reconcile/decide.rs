//! Decide: from what one reconcile observed, the whole plan of what to write. Pure: no I/O, no
//! clock, so every transition of the rollout is a table test (`decide_tests.rs`).
//!
//! Revisions: the serving one (`status.currentRevision`, verified) and the one the spec asks for.
//! When they differ, the spec's revision is the candidate: its own prefill and decode Deployments
//! come up next to the serving ones, which are never touched. Candidate pods carry the readiness
//! gate, so until they are verified they are not Ready and the router's discovery
//! (EndpointSlices) does not see them. Verified and Ready at full strength -> promoted, the old
//! revision's Deployments are deleted. Any pod failing the gate -> the revision is refused:
//! scaled to zero, recorded in status, an Event and a metric; it is not retried until the spec
//! changes (a new revision).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::bake;
use super::observe::{WorkerPod, World};
use super::status::{self, Observed};
use crate::canary::{CanaryRun, Endpoint, Reference};
use crate::conditions;
use crate::crd::{BakeStatus, InferenceDeployment, InferenceDeploymentStatus, RefusedRevision};
use crate::gate::{self, PodReport, PodVerdict, Role, Verdict};
use crate::render::workers;

/// What the gate found for one revision.
#[derive(Debug, Clone, PartialEq)]
pub struct Verification {
    pub verdict: Verdict,
    /// Per role: pods that passed, and the smallest measured pool of those that reported.
    pub verified: BTreeMap<Role, i32>,
    pub min_measured: BTreeMap<Role, u64>,
    /// Pods that exist (not terminating), per role.
    pub pods: BTreeMap<Role, i32>,
}

/// One revision's worker Deployment at the size it should have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerDeployment {
    pub role: Role,
    pub revision: String,
    pub replicas: i32,
}

/// The `kvgate.dev/kv-pool-verified` condition a pod should carry (only those that change).
#[derive(Debug, Clone, PartialEq)]
pub struct PodGate {
    pub pod: String,
    pub status: &'static str,
    pub reason: String,
    pub message: String,
    /// The transition time to keep (status unchanged); `None`: now.
    pub since: Option<Time>,
}

/// An Event to publish on the InferenceDeployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announcement {
    pub warning: bool,
    pub reason: &'static str,
    pub action: &'static str,
    pub note: String,
}

/// Everything one reconcile writes.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The spec's revision's Deployments (none when its pods may not be created at all).
    pub workers: Vec<WorkerDeployment>,
    /// Deployments of revisions that neither serve nor are the candidate.
    pub delete: Vec<String>,
    /// The router Deployment, admitting this window; `None`: leave it as it is.
    pub router_window: Option<u64>,
    /// The image the router runs: the serving revision's (`None` before one serves: the
    /// spec's). An image no revision has proven never fronts traffic.
    pub router_image: Option<String>,
    pub pod_gates: Vec<PodGate>,
    pub events: Vec<Announcement>,
    /// A refusal decided now: counted once under this reason.
    pub refused_reason: Option<String>,
    pub status: InferenceDeploymentStatus,
    /// Nothing is in flight: the spec's revision serves or stands refused.
    pub settled: bool,
    /// The integrity canary to run now (after this plan is applied), its result recorded in
    /// `status.canary` for the next pass to act on.
    pub canary: Option<CanaryRun>,
    /// Why each pod of the serving revision that no longer passes the gate fails it.
    pub unverified: Vec<String>,
    /// A rollback decided now: counted once under this reason.
    pub rollback: Option<&'static str>,
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

pub fn decide(i: Inputs<'_>) -> Plan {
    let Inputs { d, revision: rev, host_path_refusal, world, now } = i;
    let window = d.spec.context_window;
    let prev = d.status.clone().unwrap_or_default();
    let current = prev.current_revision.clone();
    let refused_before = prev.refused_revision.as_ref().is_some_and(|r| r.revision == rev);
    let refused_already = refused_before || host_path_refusal.is_some();
    let (candidate, candidate_verdicts) = verify(world, rev, window);
    let canary_spec = &d.spec.rollout.canary;
    let canary_result = prev.canary.as_ref().filter(|c| c.revision == rev);
    // Until the canary passed, a verified candidate pod's gate stays False: it takes no traffic.
    let canary_pending = Some(rev) != current.as_deref() && canary_spec.prompts > 0 && !canary_result.is_some_and(|c| c.passed);
    let mut canary = None;

    let mut refused = prev.refused_revision.clone();
    let mut refused_reason = None;
    let mut serving = current.clone();
    let mut serving_window = prev.current_context_window;
    let mut events = Vec::new();
    let mut scale_to_zero = refused_already;
    if let Some(message) = host_path_refusal.filter(|_| !refused_before) {
        let reason = crate::host_paths::REASON;
        refused = Some(RefusedRevision { revision: rev.into(), reason: reason.into(), message: message.into() });
        refused_reason = Some(reason.to_string());
        events.push(warning("RolloutRefused", "HostPathPolicy", format!("revision {rev} refused, no pod created: {message}")));
    }
    if Some(rev) != current.as_deref() && !refused_already {
        let keeps = current.as_ref().map_or("no revision serves yet".to_string(), |c| format!("revision {c} keeps serving"));
        // The candidate is refused: recorded, counted once, announced, scaled to zero.
        let mut refuse = |reason: &str, message: &str, action: &'static str, note: String| {
            refused = Some(RefusedRevision { revision: rev.into(), reason: reason.into(), message: message.into() });
            refused_reason = Some(reason.to_string());
            scale_to_zero = true;
            events.push(warning("RolloutRefused", action, format!("{note}; {keeps}")));
        };
        match &candidate.verdict {
            Verdict::Refused { failure, message } => {
                refuse(failure.reason(), message, "RolloutGate", format!("revision {rev} refused: {message}"));
            }
            Verdict::Verified if canary_result.is_some_and(|c| !c.passed) => {
                let message = canary_result.map(|c| c.message.as_str()).unwrap_or_default();
                let note = format!("revision {rev} refused before any traffic: the integrity canary failed: {message}");
                refuse(CANARY_FAILED, message, "IntegrityCanary", note);
            }
            Verdict::Verified if canary_pending && all_pods(d, &candidate) => {
                canary = canary_run(d, world, rev, current.as_deref().zip(serving_window));
            }
            // Not every pod is there yet: the canary waits for all pairs.
            Verdict::Verified if canary_pending => {}
            Verdict::Verified if full_strength(d, &candidate, |r| world.ready(&workers::deployment_name(d, r, rev))) => {
                events.push(Announcement {
                    warning: false,
                    reason: "RolloutVerified",
                    action: "RolloutGate",
                    note: format!("revision {rev}: every pod's KV pool holds contextWindow {window}; now serving"),
                });
                serving = Some(rev.to_string());
                serving_window = Some(window);
                refused = refused.filter(|r| r.revision != rev);
            }
            _ => {}
        }
    }

    // A promotion over a serving revision starts a bake, which keeps that revision beside the
    // new one; every pass of a bake watches the mismatch counters (`bake.rs`).
    let mut bake_state = prev.bake.clone().filter(|b| current.as_ref() == Some(&b.revision));
    let mut rollback = None;
    let rollout = &d.spec.rollout;
    if serving != current {
        if let (Some(previous), true) = (current.clone(), rollout.bake_seconds > 0) {
            let start = world.mismatches.as_ref().map_or(0, bake::total);
            bake_state = Some(BakeStatus {
                revision: rev.into(),
                previous,
                previous_context_window: prev.current_context_window.unwrap_or(window),
                started_at: now.clone(),
                mismatches_at_start: start,
            });
        }
    } else if let Some(b) = bake_state.clone() {
        match bake::judge(&b, world.mismatches.as_ref(), rollout.max_handoff_mismatches, rollout.bake_seconds, now) {
            bake::Verdict::Continue => {}
            bake::Verdict::Done => {
                bake_state = None;
                events.push(Announcement {
                    warning: false,
                    reason: "BakeComplete",
                    action: "Bake",
                    note: format!("revision {} baked {} s without handoff mismatches; revision {} retired", b.revision, rollout.bake_seconds, b.previous),
                });
            }
            bake::Verdict::RollBack(message) => {
                let reason = bake::HANDOFF_INTEGRITY_VIOLATION;
                serving = Some(b.previous.clone());
                serving_window = Some(b.previous_context_window);
                refused = Some(RefusedRevision { revision: b.revision.clone(), reason: reason.into(), message: message.clone() });
                refused_reason = Some(reason.to_string());
                rollback = Some(reason);
                scale_to_zero |= b.revision == rev;
                bake_state = None;
                events.push(warning("RolledBack", "Bake", format!("revision {} rolled back: {message}", b.revision)));
            }
        }
    }

    let workers = match host_path_refusal {
        Some(_) => Vec::new(),
        None => [Role::Prefill, Role::Decode]
            .into_iter()
            .map(|role| WorkerDeployment { role, revision: rev.into(), replicas: if scale_to_zero { 0 } else { d.spec.worker(role).replicas } })
            .collect(),
    };
    let kept = bake_state.as_ref().map(|b| b.previous.clone());
    let delete = world
        .deployments
        .iter()
        .filter(|dep| dep.revision != rev && Some(&dep.revision) != serving.as_ref() && Some(&dep.revision) != kept.as_ref())
        .filter(|dep| !(rollback.is_some() && refused.as_ref().is_some_and(|r| r.revision == dep.revision) && dep.revision == rev))
        .map(|dep| dep.name.clone())
        .collect();
    // The router admits what the serving revision was verified for, and runs its image.
    let router_window = serving_window.unwrap_or(window);
    let router_image = serving.as_ref().and_then(|s| world.deployments.iter().filter(|dep| &dep.revision == s).find_map(|dep| dep.image.clone()));

    // Status describes the serving revision, or before there is one, the candidate; the pods of
    // both get their gate condition.
    let shown = serving.clone().unwrap_or_else(|| rev.to_string());
    let held = (canary_pending && !refused_already && refused_reason.is_none())
        .then(|| format!("KV pool verified; the integrity canary of revision {rev} runs before this pod takes traffic"));
    let mut pod_gates = gates(world.pods_of(rev), &candidate_verdicts, held.as_deref());
    let (shown_pods, shown_verdicts) = if shown == rev {
        (candidate.clone(), candidate_verdicts.clone())
    } else {
        let (shown_pods, verdicts) = verify(world, &shown, router_window);
        pod_gates.extend(gates(world.pods_of(&shown), &verdicts, None));
        (shown_pods, verdicts)
    };
    // Serving pods are read again on every pass: one that restarted smaller, or with other
    // fingerprints, has just had its gate set False (out of the EndpointSlices).
    let unverified: Vec<String> = match &serving {
        Some(_) => shown_verdicts
            .iter()
            .filter_map(|v| match v {
                PodVerdict::Failed { message, .. } => Some(message.clone()),
                _ => None,
            })
            .collect(),
        None => Vec::new(),
    };
    let was_degraded = prev.conditions.iter().find(|c| c.type_ == conditions::DEGRADED && c.status == "True").map(|c| c.message.clone());
    match (&was_degraded, unverified.is_empty()) {
        (_, false) if was_degraded != Some(status::degraded_message(&shown, &unverified)) => events.push(warning(
            "ServingPodUnverified",
            "RolloutGate",
            format!("serving revision {shown}: {}; out of the EndpointSlices until it passes again", unverified.join("; ")),
        )),
        (Some(_), true) => events.push(Announcement {
            warning: false,
            reason: "ServingPodsVerified",
            action: "RolloutGate",
            note: format!("every pod of serving revision {shown} passes the gate again"),
        }),
        _ => {}
    }
    let observed = Observed {
        spec_revision: rev.to_string(),
        serving: serving.clone(),
        serving_window,
        refused: refused.clone(),
        candidate,
        shown_pods,
        ready: [Role::Prefill, Role::Decode].map(|r| world.ready(&workers::deployment_name(d, r, &shown))),
        router_ready: world.router_ready.unwrap_or(0),
        canary_running: held.is_some(),
        unverified: unverified.clone(),
        bake: bake_state.clone(),
    };
    let status = status::compute(d, &prev, &observed);
    let settled = (serving.as_deref() == Some(rev) && bake_state.is_none()) || refused.as_ref().is_some_and(|r| r.revision == rev);
    Plan {
        workers,
        delete,
        router_window: host_path_refusal.is_none().then_some(router_window),
        router_image,
        pod_gates,
        events,
        refused_reason,
        status,
        settled,
        canary,
        unverified,
        rollback,
    }
}

/// The refusal reason of a revision whose integrity canary failed.
pub const CANARY_FAILED: &str = "CanaryFailed";

/// Every desired pod of both roles exists and passed the pool check (Ready or not: candidate
/// pods are not Ready before the canary).
fn all_pods(d: &InferenceDeployment, v: &Verification) -> bool {
    [Role::Prefill, Role::Decode].into_iter().all(|r| {
        let want = d.spec.worker(r).replicas;
        want > 0 && v.pods.get(&r).copied().unwrap_or(0) == want && v.verified.get(&r).copied().unwrap_or(0) == want
    })
}

/// The canary for revision `rev`: its pods, and a serving pair to compare with when the
/// serving revision reports the same model and KV layout.
fn canary_run(d: &InferenceDeployment, world: &World, rev: &str, serving: Option<(&str, u64)>) -> Option<CanaryRun> {
    let endpoint = |p: &WorkerPod| Some(Endpoint { pod: p.name.clone(), ip: p.ip.clone()? });
    let of = |rev: &str, role: Role| world.pods_of(rev).filter(|p| p.role == role).filter_map(endpoint).collect::<Vec<_>>();
    let (prefill, decode) = (of(rev, Role::Prefill), of(rev, Role::Decode));
    let report = world.pods_of(rev).find_map(|p| p.report.as_ref().ok())?;
    let same_model = |p: &&WorkerPod| {
        p.report.as_ref().is_ok_and(|r| r.model_fingerprint == report.model_fingerprint && r.layout_fingerprint == report.layout_fingerprint)
            && p.condition.as_ref().is_some_and(|c| c.status == "True")
    };
    let reference = serving.and_then(|(s, context_window)| {
        let pick = |role: Role| world.pods_of(s).filter(|p| p.role == role).find(same_model).and_then(endpoint);
        Some(Reference { revision: s.to_string(), prefill: pick(Role::Prefill)?, decode: pick(Role::Decode)?, context_window })
    });
    let spec = &d.spec.rollout.canary;
    let max_tokens = spec.max_tokens.min(d.spec.context_window.saturating_sub(1).max(1) as u32);
    Some(CanaryRun {
        revision: rev.to_string(),
        prefill,
        decode,
        reference,
        prompts: spec.prompts,
        page_size: report.page_size,
        max_prompt_tokens: spec.max_prompt_tokens.min(d.spec.context_window - u64::from(max_tokens)).max(1),
        vocab: report.vocab_size.unwrap_or(2),
        max_tokens,
    })
}

fn warning(reason: &'static str, action: &'static str, note: String) -> Announcement {
    Announcement { warning: true, reason, action, note }
}

/// The gate on one revision's pods: the verdict per pod and for the revision.
fn verify(world: &World, revision: &str, context_window: u64) -> (Verification, Vec<PodVerdict>) {
    let pods: Vec<&WorkerPod> = world.pods_of(revision).collect();
    let reports: Vec<PodReport> = pods.iter().map(|p| PodReport { role: p.role, pod: p.name.clone(), report: p.report.clone().ok() }).collect();
    let (verdicts, verdict) = gate::judge(context_window, &reports);
    let mut v = Verification { verdict, verified: BTreeMap::new(), min_measured: BTreeMap::new(), pods: BTreeMap::new() };
    for (pod, pod_verdict) in pods.iter().zip(&verdicts) {
        *v.pods.entry(pod.role).or_default() += 1;
        if let Ok(r) = &pod.report {
            let m = v.min_measured.entry(pod.role).or_insert(u64::MAX);
            *m = (*m).min(r.capacity_tokens);
        }
        if matches!(pod_verdict, PodVerdict::Verified { .. }) {
            *v.verified.entry(pod.role).or_default() += 1;
        }
    }
    (v, verdicts)
}

/// The gate condition of each pod whose condition differs from its verdict; `held`: verified
/// pods stay `False` (`AwaitingCanary`) with this message.
fn gates<'w>(pods: impl Iterator<Item = &'w WorkerPod>, verdicts: &[PodVerdict], held: Option<&str>) -> Vec<PodGate> {
    pods.zip(verdicts)
        .filter_map(|(pod, verdict)| {
            let (status, reason, message) = match verdict {
                PodVerdict::Pending => {
                    let (reason, why) = match &pod.report {
                        Err(why) => (why.reason, why.message.clone()),
                        Ok(_) => {
                            ("AwaitingCapacityReport", format!("waiting for the {} pods' capacity reports to compare fingerprints", pod.role.peer().as_str()))
                        }
                    };
                    ("False", reason.to_string(), why)
                }
                PodVerdict::Verified { message } => match held {
                    Some(why) => ("False", "AwaitingCanary".to_string(), format!("{message}; {why}")),
                    None => ("True", "KVPoolVerified".to_string(), message.clone()),
                },
                PodVerdict::Failed { failure, message } => ("False", failure.reason().to_string(), message.clone()),
            };
            let existing = pod.condition.as_ref();
            if existing.is_some_and(|c| c.status == status && c.reason.as_deref() == Some(&reason) && c.message.as_deref() == Some(&message)) {
                return None;
            }
            let since = existing.filter(|c| c.status == status).and_then(|c| c.last_transition_time.clone());
            Some(PodGate { pod: pod.name.clone(), status, reason, message, since })
        })
        .collect()
}

/// Every desired pod of both roles exists, passed the gate and is Ready.
fn full_strength(d: &InferenceDeployment, v: &Verification, ready: impl Fn(Role) -> i32) -> bool {
    [Role::Prefill, Role::Decode].into_iter().all(|r| {
        let want = d.spec.worker(r).replicas;
        want > 0 && v.pods.get(&r).copied().unwrap_or(0) == want && v.verified.get(&r).copied().unwrap_or(0) == want && ready(r) >= want
    })
}

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;
