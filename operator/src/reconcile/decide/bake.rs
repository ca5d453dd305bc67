//! Step 3: the bake window after a promotion. The previous revision's Deployments stay, at their
//! size, while the new revision serves; any increase of the deployment's handoff mismatch
//! counters beyond `spec.rollout.maxHandoffMismatches` rolls back to the previous revision.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::{Inputs, Rollout, normal, total, warning};
use crate::crd::{BakeStatus, InferenceDeploymentStatus};
use crate::reasons::{EventAction, Reason};
use crate::rollout_state::RollbackReason;

/// Whether a promotion of this deployment bakes: kvgate's workers count handoff mismatches to
/// judge it on; an external engine has no such counter, so its previous revision is retired at
/// once.
pub(super) fn bakes(d: &crate::crd::InferenceDeployment) -> bool {
    d.spec.rollout.bake_seconds > 0 && d.spec.engine().integrity()
}

/// Whether the deployment's mismatch counters must be read (scraped in the background) after
/// this pass: during a bake, and when a promotion over a serving revision may start one (its
/// baseline). External engines have none: their bake watches nothing but time.
pub(super) fn counters_wanted(i: &Inputs<'_>, r: &Rollout) -> bool {
    if !bakes(i.d) {
        return false;
    }
    let canary_done = i.d.spec.rollout.canary.prompts == 0 || r.canary.as_ref().is_some_and(|c| c.revision == i.revision && c.passed);
    let promotable = r.serving.as_deref().is_some_and(|s| s != i.revision) && canary_done;
    r.bake.is_some() || promotable
}

/// Starts a bake at a promotion over a serving revision; judges the bake in progress.
pub(super) fn advance(i: &Inputs<'_>, prev: &InferenceDeploymentStatus, r: &mut Rollout) {
    let current = prev.current_revision.clone();
    r.bake = r.bake.take().filter(|b| current.as_ref() == Some(&b.revision));
    let rollout = &i.d.spec.rollout;
    if r.serving != current {
        // Promoted in this pass.
        if let (Some(previous), true) = (current, bakes(i.d)) {
            r.bake = Some(BakeStatus {
                revision: i.revision.into(),
                previous,
                previous_context_window: prev.current_context_window.unwrap_or(i.window()),
                started_at: i.now.clone(),
                mismatches_at_start: i.world.mismatches.as_ref().map_or(0, total),
            });
        }
        return;
    }
    let Some(b) = r.bake.clone() else { return };
    match judge(&b, i.world.mismatches.as_ref(), rollout.max_handoff_mismatches, rollout.bake_seconds, i.now) {
        BakeOutcome::Continue => {}
        BakeOutcome::Done => {
            r.bake = None;
            r.events.push(normal(
                Reason::BakeComplete,
                EventAction::Bake,
                format!("revision {} baked {} s without handoff mismatches; revision {} retired", b.revision, rollout.bake_seconds, b.previous),
            ));
        }
        BakeOutcome::RollBack(message) => {
            let reason = RollbackReason::HandoffIntegrityViolation;
            r.serving = Some(b.previous.clone());
            r.serving_window = Some(b.previous_context_window);
            r.refuse(&b.revision, reason.into(), &message);
            r.rollback = Some(reason);
            r.scale_to_zero |= b.revision == i.revision;
            r.bake = None;
            r.events.push(warning(Reason::RolledBack, EventAction::Bake, format!("revision {} rolled back: {message}", b.revision)));
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum BakeOutcome {
    /// Still baking.
    Continue,
    /// The window passed cleanly: the previous revision can go.
    Done,
    /// Roll back, with why (the counts by reason).
    RollBack(String),
}

/// Judges one pass of a bake: `mismatches` are the deployment's pods' counters now (by reason;
/// `None`: none could be read yet).
pub(super) fn judge(b: &BakeStatus, mismatches: Option<&BTreeMap<String, u64>>, max: u64, seconds: u64, now: &Time) -> BakeOutcome {
    let new = mismatches.map_or(0, |m| total(m).saturating_sub(b.mismatches_at_start));
    if new > max {
        let by_reason: Vec<String> = mismatches.into_iter().flatten().filter(|(_, n)| **n > 0).map(|(r, n)| format!("{r} {n}")).collect();
        return BakeOutcome::RollBack(format!(
            "{new} handoff mismatches during the bake of revision {} (more than maxHandoffMismatches {max}; counters by reason: {}); revision {} serves again",
            b.revision,
            by_reason.join(", "),
            b.previous
        ));
    }
    let elapsed = now.0.as_second() - b.started_at.0.as_second();
    if elapsed >= seconds as i64 { BakeOutcome::Done } else { BakeOutcome::Continue }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn at(s: i64) -> Time {
        Time(Timestamp::from_second(s).unwrap())
    }

    fn bake() -> BakeStatus {
        BakeStatus { revision: "r2".into(), previous: "r1".into(), previous_context_window: 2048, started_at: at(1000), mismatches_at_start: 2 }
    }

    #[test]
    fn a_bake_rolls_back_past_the_allowed_mismatches_and_ends_clean_after_its_window() {
        let counts = |checksum: u64| BTreeMap::from([("checksum".to_string(), checksum), ("timeout".to_string(), 2)]);
        assert_eq!(judge(&bake(), Some(&counts(0)), 0, 300, &at(1010)), BakeOutcome::Continue, "the counts it started with are not new");
        assert_eq!(judge(&bake(), None, 0, 300, &at(1010)), BakeOutcome::Continue);
        assert_eq!(judge(&bake(), Some(&counts(1)), 1, 300, &at(1010)), BakeOutcome::Continue, "one allowed");
        let BakeOutcome::RollBack(why) = judge(&bake(), Some(&counts(2)), 1, 300, &at(1010)) else { panic!() };
        assert_eq!(
            why,
            "2 handoff mismatches during the bake of revision r2 (more than maxHandoffMismatches 1; counters by reason: checksum 2, timeout 2); revision r1 serves again"
        );
        assert_eq!(judge(&bake(), Some(&counts(0)), 0, 300, &at(1300)), BakeOutcome::Done);
    }

    #[test]
    fn a_counter_that_went_down_a_pod_restart_is_no_mismatch() {
        let counts = BTreeMap::from([("timeout".to_string(), 1)]);
        assert_eq!(judge(&bake(), Some(&counts), 0, 300, &at(1010)), BakeOutcome::Continue);
    }
}
