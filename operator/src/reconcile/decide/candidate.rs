//! Step 1: judge the spec's revision while it is the candidate (not yet serving, not refused):
//! refuse it (a pod failed the gate, or its canary failed), hold it for the canary, or promote
//! it once every desired pod is verified and Ready.

use super::{Inputs, Rollout, all_pods, canary, normal, warning};
use crate::gate::RevisionVerdict;
use crate::reasons::{EventAction, Reason};
use crate::render::workers;
use crate::rollout_state::RefusalReason;

use super::gates::Verification;

pub(super) fn judge(i: &Inputs<'_>, candidate: &Verification, r: &mut Rollout) {
    let rev = i.revision;
    if let Some(message) = i.host_path_refusal {
        r.scale_to_zero = true;
        if !r.refused(rev) {
            r.refuse(rev, RefusalReason::HostPathNotAllowed, message);
            r.events.push(warning(Reason::RolloutRefused, EventAction::HostPathPolicy, format!("revision {rev} refused, no pod created: {message}")));
        }
        return;
    }
    if r.refused(rev) {
        r.scale_to_zero = true;
        return;
    }
    if r.serving.as_deref() == Some(rev) {
        return;
    }
    let keeps = r.serving.as_ref().map_or("no revision serves yet".to_string(), |c| format!("revision {c} keeps serving"));
    let refuse = |r: &mut Rollout, reason: RefusalReason, message: &str, action: EventAction, note: String| {
        r.refuse(rev, reason, message);
        r.scale_to_zero = true;
        r.events.push(warning(Reason::RolloutRefused, action, format!("{note}; {keeps}")));
    };
    match &candidate.verdict {
        RevisionVerdict::Refused { failure, message } => refuse(r, *failure, message, EventAction::RolloutGate, format!("revision {rev} refused: {message}")),
        RevisionVerdict::Pending => {}
        RevisionVerdict::Verified => {
            if let Some((reason, message)) = canary::failed(r, rev) {
                let note = format!("revision {rev} refused before any traffic: the integrity canary failed: {message}");
                refuse(r, reason, &message, EventAction::IntegrityCanary, note);
            } else if r.canary_pending {
                // Every pod must be there: the canary drives every prefill x decode pair.
                if all_pods(i.d, candidate) {
                    r.canary_run = canary::run(i, r);
                }
            } else if full_strength(i, candidate) && baseline_known(i, r) {
                r.events.push(normal(
                    Reason::RolloutVerified,
                    EventAction::RolloutGate,
                    format!("revision {rev}: every pod's KV pool holds contextWindow {}; now serving", i.window()),
                ));
                r.serving = Some(rev.to_string());
                r.serving_window = Some(i.window());
                r.refused = r.refused.take().filter(|x| x.revision != rev);
            }
        }
    }
}

/// Every desired pod of every role exists, passed the gate and is Ready.
fn full_strength(i: &Inputs<'_>, v: &Verification) -> bool {
    all_pods(i.d, v) && i.d.spec.roles().iter().all(|&role| i.world.ready(&workers::deployment_name(i.d, role, i.revision)) >= i.d.spec.replicas(role))
}

/// A promotion over a serving revision starts a bake whose baseline is the deployment's
/// mismatch counters at that moment: it waits until they have been read.
fn baseline_known(i: &Inputs<'_>, r: &Rollout) -> bool {
    r.serving.is_none() || !super::bake::bakes(i.d) || (i.world.mismatches.is_some() && !i.world.mismatches_partial)
}

#[cfg(test)]
mod tests {
    use super::super::tests::*;
    use super::*;

    #[test]
    fn a_verified_candidate_is_promoted_only_at_full_strength_and_with_a_bake_baseline() {
        let (mut d, mut world) = serving_r1();
        d.spec.rollout.bake_seconds = 60;
        d.spec.context_window = 4096;
        revision(&mut world, &d, "r2", Ok(report(8192, "l")), true);
        world.mismatches = None;
        let plan = pass(&mut d, "r2", &world);
        assert_eq!(plan.status.current_revision.as_deref(), Some("r1"), "no baseline for the bake yet: not promoted");
        world.mismatches = Some(Default::default());
        let plan = pass(&mut d, "r2", &world);
        assert_eq!(plan.status.current_revision.as_deref(), Some("r2"));
    }

    #[test]
    fn a_revision_refused_before_stays_at_zero_and_is_not_counted_again() {
        let mut d = deployment(1_048_576);
        let mut world = World::default();
        revision(&mut world, &d, "r1", Ok(report(681_280, "l")), false);
        assert_eq!(pass(&mut d, "r1", &world).refused_reason, Some(RefusalReason::KVPoolBelowContextWindow));
        // A pod that now reports enough changes nothing: the revision is refused for good.
        let mut world = World::default();
        revision(&mut world, &d, "r1", Ok(report(2_000_000, "l")), true);
        let plan = pass(&mut d, "r1", &world);
        assert_eq!((plan.refused_reason, plan.events.len(), plan.status.current_revision.clone()), (None, 0, None));
        assert!(plan.workers.iter().all(|w| w.replicas == 0));
    }
}
