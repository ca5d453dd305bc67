//! Step 5: the readiness gate. Every pod of the spec's revision and of the serving revision gets
//! the `kvgate.dev/kv-pool-verified` condition its verdict calls for (written only when it
//! changes); verified candidate pods stay `False` while the canary is pending; a serving pod
//! that no longer passes (restarted smaller, other fingerprints) is out at once, and the
//! deployment is `Degraded` until it passes again. A serving pod whose integrity counters grow
//! (a handoff it refused, a transfer its engine failed) makes the deployment `Degraded` too,
//! until they hold still for the quiet window (`bake::quiet`), but stays in: each such handoff
//! was refused, not decoded from, and taking pods out on a counter the peer may have caused (a
//! decode counts what a bad prefill sent) would turn one bad link into an outage.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::{Announcement, Inputs, Rollout, failures, normal, warning};
use crate::capacity::NoReportReason;
use crate::conditions;
use crate::crd::InferenceDeploymentStatus;
use crate::gate::{self, PodReport, PodVerdict, RevisionVerdict, Role};
use crate::reasons::{EventAction, Reason};
use crate::reconcile::observe::{WorkerPod, World};

/// What the gate found for one revision.
#[derive(Debug, Clone, PartialEq)]
pub struct Verification {
    pub verdict: RevisionVerdict,
    /// Per role: pods that passed, and the smallest measured pool of those that reported.
    pub verified: BTreeMap<Role, i32>,
    pub min_measured: BTreeMap<Role, u64>,
    /// Pods that exist (not terminating), per role.
    pub pods: BTreeMap<Role, i32>,
    /// The prefill pod whose measured prefill rate makes a prompt of the whole window slowest.
    pub slowest_prefill: Option<PrefillEstimate>,
}

/// A prefill pod's measured rate, extrapolated to the declared window.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillEstimate {
    pub pod: String,
    pub timings: kvgate_proto::PrefillTimings,
    /// Estimated milliseconds to prefill a prompt of the whole window.
    pub window_ms: u64,
}

/// The `kvgate.dev/kv-pool-verified` condition a pod should carry (only those that change).
#[derive(Debug, Clone, PartialEq)]
pub struct PodGate {
    pub pod: String,
    /// The condition's status: `True` lets the pod become Ready.
    pub verified: bool,
    pub reason: Reason,
    pub message: String,
    /// The transition time: kept while the status is unchanged, else the pass's.
    pub since: Time,
}

impl PodGate {
    /// The condition's status as Kubernetes spells it.
    pub fn status(&self) -> &'static str {
        condition_status(self.verified)
    }
}

fn condition_status(ok: bool) -> &'static str {
    if ok { "True" } else { "False" }
}

pub(super) struct Gates {
    pub pod_gates: Vec<PodGate>,
    /// The gate's findings on the revision status shows (the serving one, else the spec's).
    pub shown: Verification,
    /// Why each serving pod that fails the gate fails it.
    pub unverified: Vec<String>,
    /// Each serving pod whose integrity counters grew: engine, role, pod and what grew.
    pub integrity: Vec<String>,
    pub events: Vec<Announcement>,
}

pub(super) fn plan(i: &Inputs<'_>, prev: &InferenceDeploymentStatus, r: &Rollout, candidate: &[PodVerdict]) -> Gates {
    let rev = i.revision;
    let held =
        (r.canary_pending && !r.refused(rev)).then(|| format!("KV pool verified; the integrity canary of revision {rev} runs before this pod takes traffic"));
    let mut pod_gates = conditions_for(i.world.pods_of(rev), candidate, held.as_deref(), i.now);
    let shown = r.serving.clone().unwrap_or_else(|| rev.to_string());
    let (shown_pods, shown_verdicts) = verify(i.world, &shown, r.serving_window.unwrap_or(i.window()));
    if shown != rev {
        pod_gates.extend(conditions_for(i.world.pods_of(&shown), &shown_verdicts, None, i.now));
    }
    // Serving pods are read again on every pass: one that restarted smaller, or with other
    // fingerprints, has just had its gate set False (out of the Service's endpoints).
    let unverified = if r.serving.is_some() { failures(&shown_verdicts) } else { Vec::new() };
    let integrity = if r.serving.is_some() { violations(i, &shown) } else { Vec::new() };
    let mut events = Vec::new();
    let was = prev.conditions.iter().find(|c| c.type_ == conditions::DEGRADED && c.status == "True");
    // Each finding is announced when the condition did not say it yet.
    let said = |found: &[String]| was.is_some_and(|c| found.iter().all(|f| c.message.contains(f.as_str())));
    if !unverified.is_empty() && !said(&unverified) {
        events.push(warning(
            Reason::ServingPodUnverified,
            EventAction::RolloutGate,
            format!("serving revision {shown}: {}; out of the Service's endpoints until it passes again", unverified.join("; ")),
        ));
    } else if unverified.is_empty() && was.is_some_and(|c| c.reason == Reason::ServingPodUnverified.as_str()) {
        events.push(normal(Reason::ServingPodsVerified, EventAction::RolloutGate, format!("every pod of serving revision {shown} passes the gate again")));
    }
    let quiet = super::bake::quiet(i.d).as_secs();
    if !integrity.is_empty() && !said(&integrity) {
        events.push(warning(
            Reason::HandoffMismatchesCounted,
            EventAction::IntegrityWatch,
            format!(
                "serving revision {shown}: {}; each was refused, not decoded from; Degraded until the counters hold still for {quiet} s",
                integrity.join("; ")
            ),
        ));
    } else if integrity.is_empty() && was.is_some_and(|c| c.message.contains(UNVERIFIED_HANDOFFS)) {
        events.push(normal(
            Reason::HandoffCountersQuiet,
            EventAction::IntegrityWatch,
            format!("the integrity counters of serving revision {shown}'s pods held still for {quiet} s"),
        ));
    }
    // Advisory: a window the prefill pods cannot prefill before the handoff deadline is said
    // once, when it becomes so (the condition keeps saying it).
    if let Some(p) = &shown_pods.slowest_prefill {
        let (ok, reason, message) = prefill_deadline(p, i.window(), i.d.spec.handoff.timeout_ms);
        let said = prev.conditions.iter().any(|c| c.type_ == conditions::PREFILL_WITHIN_DEADLINE && c.reason == reason.as_str());
        if !ok && !said {
            events.push(warning(Reason::PrefillSlowerThanHandoffTimeout, EventAction::RolloutGate, message));
        }
    }
    Gates { pod_gates, shown: shown_pods, unverified, integrity, events }
}

/// The serving pods in an integrity violation, as `vllm decode pod NAME: checksum 0 -> 2`.
fn violations(i: &Inputs<'_>, serving: &str) -> Vec<String> {
    let engine = i.d.spec.engine.as_str();
    i.world
        .pods_of(serving)
        .filter_map(|p| Some(format!("{engine} {} pod {}: {}", p.role.as_str(), p.name, i.world.integrity_violations.get(&p.name)?.join(", "))))
        .collect()
}

/// The gate on one revision's pods: the verdict per pod and for the revision.
pub(super) fn verify(world: &World, revision: &str, context_window: u64) -> (Verification, Vec<PodVerdict>) {
    let pods: Vec<&WorkerPod> = world.pods_of(revision).collect();
    let reports: Vec<PodReport> = pods
        .iter()
        .map(|p| PodReport {
            role: p.role,
            pod: p.name.clone(),
            report: p.report.clone().ok(),
            caught: world.probe_failures.get(&p.name).cloned(),
            containers_ready: p.containers_ready,
        })
        .collect();
    let (verdicts, verdict) = gate::judge(context_window, &reports);
    let mut v = Verification { verdict, verified: BTreeMap::new(), min_measured: BTreeMap::new(), pods: BTreeMap::new(), slowest_prefill: None };
    for (pod, pod_verdict) in pods.iter().zip(&verdicts) {
        *v.pods.entry(pod.role).or_default() += 1;
        if let Ok(r) = &pod.report {
            let m = v.min_measured.entry(pod.role).or_insert(u64::MAX);
            *m = (*m).min(r.tokens());
        }
        if let Ok(gate::Measured::Kvgate(kvgate_proto::CapacityReport { prefill_timings: Some(t), .. })) = &pod.report {
            let window_ms = t.estimate_ms(context_window) as u64;
            if v.slowest_prefill.as_ref().is_none_or(|s| s.window_ms < window_ms) {
                v.slowest_prefill = Some(PrefillEstimate { pod: pod.name.clone(), timings: t.clone(), window_ms });
            }
        }
        if matches!(pod_verdict, PodVerdict::Verified { .. }) {
            *v.verified.entry(pod.role).or_default() += 1;
        }
    }
    (v, verdicts)
}

/// The gate condition of each pod whose condition differs from its verdict; `held`: verified
/// pods stay `False` (`AwaitingCanary`) with this message.
fn conditions_for<'w>(pods: impl Iterator<Item = &'w WorkerPod>, verdicts: &[PodVerdict], held: Option<&str>, now: &Time) -> Vec<PodGate> {
    pods.zip(verdicts)
        .filter_map(|(pod, verdict)| {
            let (verified, reason, message) = match verdict {
                PodVerdict::Pending => {
                    let (reason, why) = match &pod.report {
                        Err(why) => (Reason::NoReport(why.reason), why.message.clone()),
                        Ok(_) => {
                            let peer = pod.role.peer().map_or("other", |p| p.as_str());
                            (Reason::NoReport(NoReportReason::Awaiting), format!("waiting for the {peer} pods' capacity reports to compare fingerprints"))
                        }
                    };
                    (false, reason, why)
                }
                PodVerdict::Verified { message } => match held {
                    Some(why) => (false, Reason::AwaitingCanary, format!("{message}; {why}")),
                    None => (true, Reason::KVPoolVerified, message.clone()),
                },
                PodVerdict::Failed { failure, message } => (false, Reason::Refused(*failure), message.clone()),
            };
            let status = condition_status(verified);
            let existing = pod.condition.as_ref();
            if existing.is_some_and(|c| c.status == status && c.reason.as_deref() == Some(reason.as_str()) && c.message.as_deref() == Some(&message)) {
                return None;
            }
            let since = existing.filter(|c| c.status == status).and_then(|c| c.last_transition_time.clone()).unwrap_or_else(|| now.clone());
            Some(PodGate { pod: pod.name.clone(), verified, reason, message, since })
        })
        .collect()
}

/// How the `Degraded` condition's message introduces the pods that counted KV that moved wrong.
const UNVERIFIED_HANDOFFS: &str = "handoffs that did not verify";

/// The `Degraded` condition's message: the serving revision, why each pod fails the gate,
/// which cannot start, and which counted KV that moved wrong.
pub fn degraded_message(serving: &str, unverified: &[String], stuck: &[String], integrity: &[String]) -> String {
    let mut parts = Vec::new();
    let out: Vec<&str> = unverified.iter().chain(stuck).map(String::as_str).collect();
    if !out.is_empty() {
        parts.push(format!("{}; those pods take no traffic", out.join("; ")));
    }
    if !integrity.is_empty() {
        parts.push(format!("{UNVERIFIED_HANDOFFS}: {}", integrity.join("; ")));
    }
    format!("serving revision {serving}: {}", parts.join("; "))
}

/// Whether the slowest prefill pod, at the rate it measured, prefills a prompt of the whole
/// window before the handoff deadline; the condition's status, reason and message.
pub fn prefill_deadline(p: &PrefillEstimate, window: u64, timeout_ms: u64) -> (bool, Reason, String) {
    let t = &p.timings;
    let measured =
        format!("prefill pod {} measured {} tokens in {} ms and {} in {} ms", p.pod, t.tokens[0], t.micros[0] / 1000, t.tokens[1], t.micros[1] / 1000);
    if p.window_ms <= timeout_ms {
        let message = format!(
            "{measured}: a prompt of the whole contextWindow ({window} tokens) takes about {} s, within the handoff timeout of {} s",
            p.window_ms / 1000,
            timeout_ms / 1000
        );
        return (true, Reason::WithinHandoffTimeout, message);
    }
    let fits = t.tokens_within(timeout_ms as f64);
    let message = format!(
        "{measured}: a prompt of the whole contextWindow ({window} tokens) would take about {} s, past the handoff timeout of {} s; prompts over about {fits} tokens will be answered 504 prefill_deadline_exceeded. Raise spec.handoff.timeoutMs, give prefill more compute, or declare a smaller contextWindow",
        p.window_ms / 1000,
        timeout_ms / 1000
    );
    (false, Reason::WindowExceedsHandoffTimeout, message)
}

#[cfg(test)]
mod tests {
    use super::super::tests::*;
    use crate::reconcile::observe::NoReport;

    #[test]
    fn a_restarted_pod_is_out_until_it_is_read_again() {
        let (mut d, world) = serving_r1();
        let plan = pass(&mut d, "r1", &world);
        let mut restarted = world_with_conditions(&world, &plan);
        // Its container restarted: the report it gave before says nothing of the new process.
        restarted.pods[0].report = Err(NoReport::waiting("the container restarted: reading its capacity report again"));
        let plan = pass(&mut d, "r1", &restarted);
        let gate = plan.pod_gates.iter().find(|g| g.pod == "llm-prefill-r1-0").expect("a gate write");
        assert_eq!((gate.status(), gate.reason.as_str()), ("False", "AwaitingCapacityReport"));
        assert!(gate.message.contains("restarted"), "{gate:?}");
        // Unread is not unverified: no Degraded Event for a pod being read.
        assert!(plan.unverified.is_empty() && plan.events.is_empty(), "{plan:?}");
    }
}
