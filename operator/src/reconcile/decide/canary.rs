//! Step 2: the integrity canary. A candidate whose pools are verified stays out of traffic until
//! its canary passed. The canary runs in the background (`tasks::canaries`); a pass records a
//! finished run in `status.canary` (once, with its Event) and asks for one while none finished.

use super::{Inputs, Rollout, normal, warning};
use crate::canary::{CanaryRun, Endpoint, Reference};
use crate::gate::Role;
use crate::reconcile::observe::WorkerPod;

/// Records a run that finished since the last pass, and whether the candidate still waits for
/// its canary.
pub(super) fn record(i: &Inputs<'_>, r: &mut Rollout) {
    let rev = i.revision;
    let recorded = r.canary.as_ref().is_some_and(|c| c.revision == rev);
    if let Some(done) = i.world.canary.as_ref().filter(|c| c.revision == rev && !recorded && !r.refused(rev)) {
        let note = format!("revision {rev}: {}", done.message);
        r.events.push(if done.passed { normal("CanaryPassed", "IntegrityCanary", note) } else { warning("CanaryFailed", "IntegrityCanary", note) });
        r.canary = Some(done.clone());
    }
    let passed = r.canary.as_ref().is_some_and(|c| c.revision == rev && c.passed);
    r.canary_pending = Some(rev) != r.serving.as_deref() && i.d.spec.rollout.canary.prompts > 0 && !passed;
}

/// Why the spec's revision's canary failed, if it did.
pub(super) fn failed(r: &Rollout, rev: &str) -> Option<String> {
    r.canary.as_ref().filter(|c| c.revision == rev && !c.passed).map(|c| c.message.clone())
}

/// The canary for the spec's revision: its pods, and a serving pair to compare with when the
/// serving revision reports the same model and KV layout.
pub(super) fn run(i: &Inputs<'_>, r: &Rollout) -> Option<CanaryRun> {
    let (world, rev) = (i.world, i.revision);
    let endpoint = |p: &WorkerPod| Some(Endpoint { pod: p.name.clone(), ip: p.ip.clone()? });
    let of = |rev: &str, role: Role| world.pods_of(rev).filter(|p| p.role == role).filter_map(endpoint).collect::<Vec<_>>();
    let (prefill, decode) = (of(rev, Role::Prefill), of(rev, Role::Decode));
    let report = world.pods_of(rev).find_map(|p| p.report.as_ref().ok())?;
    let same_model = |p: &&WorkerPod| {
        p.report.as_ref().is_ok_and(|r| r.model_fingerprint == report.model_fingerprint && r.layout_fingerprint == report.layout_fingerprint)
            && p.condition.as_ref().is_some_and(|c| c.status == "True")
    };
    let reference = r.serving.as_deref().zip(r.serving_window).and_then(|(s, context_window)| {
        let pick = |role: Role| world.pods_of(s).filter(|p| p.role == role).find(same_model).and_then(endpoint);
        Some(Reference { revision: s.to_string(), prefill: pick(Role::Prefill)?, decode: pick(Role::Decode)?, context_window })
    });
    let spec = &i.d.spec.rollout.canary;
    let max_tokens = spec.max_tokens.min(i.window().saturating_sub(1).max(1) as u32);
    Some(CanaryRun {
        revision: rev.to_string(),
        prefill,
        decode,
        reference,
        prompts: spec.prompts,
        page_size: report.page_size,
        max_prompt_tokens: spec.max_prompt_tokens.min(i.window() - u64::from(max_tokens)).max(1),
        vocab: report.vocab_size.unwrap_or(2),
        max_tokens,
    })
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
        world.canary = Some(CanaryStatus { revision: "r1".into(), passed: true, message: "3 prompts".into() });
        let plan = pass(&mut d, "r1", &world);
        assert_eq!(plan.status.canary.as_ref().map(|c| c.passed), Some(true));
        assert_eq!(plan.events.iter().map(|e| e.reason).collect::<Vec<_>>(), ["CanaryPassed"]);
        assert!(plan.canary.is_none(), "passed: no run wanted");
        assert!(plan.pod_gates.iter().all(|g| g.status == "True"), "the same pass opens the gates: {:?}", plan.pod_gates);
        let again = pass(&mut d, "r1", &world);
        assert!(again.events.iter().all(|e| e.reason != "CanaryPassed"), "recorded once");

        // A run that finishes after its revision was refused is not recorded.
        let mut d = deployment(1_048_576);
        canary_on(&mut d);
        let mut world = World::default();
        revision(&mut world, &d, "r1", Ok(report(681_280, "l")), false);
        pass(&mut d, "r1", &world);
        world.canary = Some(CanaryStatus { revision: "r1".into(), passed: true, message: "late".into() });
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
        assert!(plan.pod_gates.iter().all(|g| g.status == "False"), "verified pods still take no traffic: {:?}", plan.pod_gates);
    }
}
