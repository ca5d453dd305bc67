//! Step 2: the integrity canary. A candidate whose pools are verified stays out of traffic until
//! its canary passed. The canary runs in the background (`tasks::canaries`); a pass records a
//! finished run in `status.canary` (once, with its Event) and asks for one while none finished.

use super::{Inputs, Rollout, normal, warning};
use crate::canary::prompts::ENGINE_VOCAB;
use crate::canary::{Boundary, CanaryRun, Counted, Endpoint, Reference, ServingRun, Target, prompts};
use crate::gate::{Measured, Role};
use crate::reasons::{EventAction, Reason};
use crate::reconcile::observe::WorkerPod;
use crate::rollout_state::RefusalReason;

/// Records a run that finished since the last pass, and whether the candidate still waits for
/// its canary.
pub(super) fn record(i: &Inputs<'_>, r: &mut Rollout) {
    let rev = i.revision;
    let recorded = r.canary.as_ref().is_some_and(|c| c.revision == rev);
    if let Some(done) = i.world.canary.as_ref().filter(|c| c.revision == rev && !recorded && !r.refused(rev)) {
        let note = format!("revision {rev}: {}", done.message);
        r.events.push(if done.passed {
            normal(Reason::CanaryPassed, EventAction::IntegrityCanary, note)
        } else {
            warning(Reason::Refused(failure(done)), EventAction::IntegrityCanary, note)
        });
        r.canary = Some(done.clone());
    }
    let passed = r.canary.as_ref().is_some_and(|c| c.revision == rev && c.passed);
    r.canary_pending = Some(rev) != r.serving.as_deref() && i.d.spec.rollout.canary.prompts > 0 && !passed;
}

/// Why the spec's revision's canary failed, if it did.
pub(super) fn failed(r: &Rollout, rev: &str) -> Option<(RefusalReason, String)> {
    r.canary.as_ref().filter(|c| c.revision == rev && !c.passed).map(|c| (failure(c), c.message.clone()))
}

/// A failed run's reason (runs recorded before reasons were: `CanaryFailed`).
fn failure(c: &crate::crd::CanaryStatus) -> RefusalReason {
    c.reason.unwrap_or(RefusalReason::CanaryFailed)
}

/// The canary for the spec's revision: its pods, and a serving pair (or pod) to compare with
/// when the serving revision serves the same model (and, for kvgate, KV layout).
pub(super) fn run(i: &Inputs<'_>, r: &Rollout) -> Option<CanaryRun> {
    let (world, rev) = (i.world, i.revision);
    let report = world.pods_of(rev).find_map(|p| p.report.as_ref().ok())?;
    let same_model =
        |p: &&WorkerPod| p.report.as_ref().is_ok_and(|m| identity(m) == identity(report)) && p.condition.as_ref().is_some_and(|c| c.status == "True");
    let spec = &i.d.spec.rollout.canary;
    let probe = &i.d.spec.rollout.boundary_probe;
    let max_tokens = spec.max_tokens.min(i.window().saturating_sub(1).max(1) as u32);
    let reference = r.serving.as_deref().zip(r.serving_window).and_then(|(s, context_window)| {
        let target = target(i, s, report, |p| same_model(&p), true)?;
        Some(Reference { revision: s.to_string(), target, context_window })
    });
    let page_size = match report {
        Measured::Kvgate(k) => k.page_size,
        Measured::Engine(_) => 16,
    };
    let vocab = vocab(report);
    // Every KV pod of the candidate, whatever the canary's questions go through.
    let counters = i.d.spec.engine().integrity_counters(&i.d.spec);
    let counted = if counters.is_empty() { Vec::new() } else { counted(i, rev) };
    Some(CanaryRun {
        revision: rev.to_string(),
        target: target(i, rev, report, |_| true, false)?,
        reference,
        prompts: spec.prompts,
        page_size,
        max_prompt_tokens: spec.max_prompt_tokens.min(i.window() - u64::from(max_tokens)).max(1),
        vocab,
        max_tokens,
        boundary: probe.canary.then_some(Boundary { window: i.window(), full: i.window() <= probe.max_prompt_tokens }),
        stale_kv: (probe.stale_kv_fillers > 0).then_some(probe.stale_kv_fillers),
        counted,
        counters,
    })
}

/// The revision's KV pods with an address, and the port of their `/metrics`.
fn counted(i: &Inputs<'_>, rev: &str) -> Vec<Counted> {
    let kv = i.world.pods_of(rev).filter(|p| p.role.holds_kv());
    kv.filter_map(|p| Some(Counted { pod: p.name.clone(), role: p.role, ip: p.ip.clone()?, port: i.d.spec.port(p.role) })).collect()
}

/// The probes on the serving revision's pairs or pods, when `boundaryProbe.servingEverySeconds`
/// asks for them: every pod with a capacity report is asked (one a round caught stays asked, so
/// a later round can clear it).
pub(super) fn serving(i: &Inputs<'_>, r: &Rollout) -> Option<ServingRun> {
    let probe = &i.d.spec.rollout.boundary_probe;
    let (rev, window) = (r.serving.as_deref()?, r.serving_window?);
    if probe.serving_every_seconds == 0 {
        return None;
    }
    let report = i.world.pods_of(rev).find_map(|p| p.report.as_ref().ok())?;
    let max_tokens = i.d.spec.rollout.canary.max_tokens.min(window.saturating_sub(1).max(1) as u32);
    let reference = prompts::of_len(window.saturating_sub(u64::from(max_tokens)).clamp(1, 64), vocab(report), 0x5e);
    Some(ServingRun {
        revision: rev.to_string(),
        target: target(i, rev, report, |p| p.report.is_ok(), false)?,
        window,
        reference,
        max_tokens,
        vocab: vocab(report),
        every_seconds: probe.serving_every_seconds,
        max_tokens_per_hour: probe.max_prefill_tokens_per_hour,
    })
}

/// The token ids the canary's and the probes' prompts draw from.
fn vocab(report: &Measured) -> u32 {
    match report {
        Measured::Kvgate(k) => k.vocab_size.unwrap_or(2),
        Measured::Engine(_) => ENGINE_VOCAB,
    }
}

/// What makes two pods' outputs comparable: model and layout fingerprints, or the engine's
/// model identity.
fn identity(m: &Measured) -> (&str, &str) {
    match m {
        Measured::Kvgate(k) => (&k.model_fingerprint, &k.layout_fingerprint),
        Measured::Engine(e) => (&e.model, e.engine.as_str()),
    }
}

/// The revision's pods the canary drives (`keep` picks them; `one`: a single pair or pod).
fn target(i: &Inputs<'_>, rev: &str, report: &Measured, keep: impl Fn(&WorkerPod) -> bool, one: bool) -> Option<Target> {
    let endpoint = |p: &WorkerPod| {
        // The process the pod's report (read and verified by the probe) names: the canary's
        // signed calls are for it.
        let instance = match &p.report {
            Ok(Measured::Kvgate(r)) => r.instance.parse().ok(),
            _ => None,
        };
        Some(Endpoint { pod: p.name.clone(), ip: p.ip.clone()?, instance })
    };
    let of = |role: Role| {
        let pods = i.world.pods_of(rev).filter(|p| p.role == role && keep(p)).filter_map(endpoint);
        if one { pods.take(1).collect::<Vec<_>>() } else { pods.collect() }
    };
    let target = match report {
        Measured::Kvgate(_) => Target::Pairs { prefill: of(Role::Prefill), decode: of(Role::Decode) },
        Measured::Engine(e) => {
            // A disaggregated engine is asked through its revision's router: it holds no KV
            // (nothing to compare), so the revision's KV-holding pods must pass `keep`.
            let api = i.d.spec.engine().api_role(&i.d.spec);
            let pods = if api.holds_kv() {
                of(api)
            } else if i.world.pods_of(rev).filter(|p| p.role.holds_kv()).all(&keep) {
                // Only a router that answers its own readiness probe is listening.
                let routers =
                    i.world.pods_of(rev).filter(|p| p.role == api && p.containers_ready && (!one || p.condition.as_ref().is_some_and(|c| c.status == "True")));
                let routers = routers.filter_map(endpoint);
                if one { routers.take(1).collect() } else { routers.collect() }
            } else {
                Vec::new()
            };
            Target::Servers { engine: e.engine, role: api, port: i.d.spec.port(api), model: e.model.clone(), pods }
        }
    };
    let empty = match &target {
        Target::Pairs { prefill, decode } => prefill.is_empty() || decode.is_empty(),
        Target::Servers { pods, .. } => pods.is_empty(),
    };
    (!empty).then_some(target)
}

#[cfg(test)]
mod tests {
    use super::super::tests::*;
    use crate::crd::CanaryStatus;

    #[test]
    fn a_finished_run_is_recorded_once_with_its_event_and_never_for_a_refused_revision() {
        let mut d = deployment(WINDOW);
        canary_on(&mut d);
        let mut world = World::default();
        revision(&mut world, &d, "r1", Ok(report(8192, "l")), false);
        let plan = pass(&mut d, "r1", &world);
        assert!(plan.canary.is_some() && plan.status.canary.is_none());
        world.canary = Some(CanaryStatus { revision: "r1".into(), passed: true, message: "3 prompts".into(), reason: None });
        let plan = pass(&mut d, "r1", &world);
        assert_eq!(plan.status.canary.as_ref().map(|c| c.passed), Some(true));
        assert_eq!(plan.events.iter().map(|e| e.reason).collect::<Vec<_>>(), ["CanaryPassed"]);
        assert!(plan.canary.is_none(), "passed: no run wanted");
        assert!(plan.pod_gates.iter().all(|g| g.verified), "the same pass opens the gates: {:?}", plan.pod_gates);
        let again = pass(&mut d, "r1", &world);
        assert!(again.events.iter().all(|e| e.reason != "CanaryPassed"), "recorded once");

        // A run that finishes after its revision was refused is not recorded.
        let mut d = deployment(1_048_576);
        canary_on(&mut d);
        let mut world = World::default();
        revision(&mut world, &d, "r1", Ok(report(681_280, "l")), false);
        pass(&mut d, "r1", &world);
        world.canary = Some(CanaryStatus { revision: "r1".into(), passed: true, message: "late".into(), reason: None });
        let plan = pass(&mut d, "r1", &world);
        assert!(plan.status.canary.is_none() && plan.events.is_empty(), "{plan:?}");
    }

    #[test]
    fn no_canary_runs_before_every_pod_is_there_and_the_phase_says_so() {
        let mut d = deployment(WINDOW);
        canary_on(&mut d);
        let mut world = World::default();
        revision(&mut world, &d, "r1", Ok(report(8192, "l")), false);
        world.pods.retain(|p| p.name != "llm-decode-r1-1");
        let plan = pass(&mut d, "r1", &world);
        assert!(plan.canary.is_none());
        assert_eq!(phase(&plan), "Progressing", "not Canary: not every pod was verified");
        assert!(plan.pod_gates.iter().all(|g| !g.verified), "verified pods still take no traffic: {:?}", plan.pod_gates);
    }
}
