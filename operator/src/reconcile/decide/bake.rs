//! Step 3: the bake window after a promotion. The previous revision's Deployments stay, at their
//! size, while the new revision serves; any increase of the deployment's integrity counters
//! (kvgate's handoff mismatches, a disaggregated engine's own: `engines::integrity`) beyond
//! `spec.rollout.maxHandoffMismatches` rolls back to the previous revision. The counters are
//! read while a revision serves too, more slowly (`counters_wanted`).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::{Inputs, Rollout, normal, warning};
use crate::crd::{BakeStatus, InferenceDeploymentStatus};
use crate::engines::integrity::{self, Counts, total};
use crate::reasons::{EventAction, Reason};
use crate::rollout_state::RollbackReason;
use crate::tasks::scrapes::{self, Pace};

/// Whether a promotion of this deployment bakes: its engine counts KV that moved wrong (kvgate's
/// workers, a disaggregated vLLM) to judge it on; an engine that moves no KV between pods has no
/// such counter, so its previous revision is retired at once.
pub(super) fn bakes(d: &crate::crd::InferenceDeployment) -> bool {
    d.spec.rollout.bake_seconds > 0 && !d.spec.engine().integrity_counters(&d.spec).is_empty()
}

/// How the deployment's integrity counters are read after this pass: fast during a bake and
/// when a promotion over a serving revision may start one (its baseline), slower while a
/// revision just serves (a serving pod whose counters grow makes the deployment Degraded:
/// `gates`). Engines without counters are never scraped.
pub(super) fn counters_wanted(i: &Inputs<'_>, r: &Rollout) -> Option<Pace> {
    if i.d.spec.engine().integrity_counters(&i.d.spec).is_empty() || r.serving.is_none() {
        return None;
    }
    let canary_done = i.d.spec.rollout.canary.prompts == 0 || r.canary.as_ref().is_some_and(|c| c.revision == i.revision && c.passed);
    let promotable = r.serving.as_deref().is_some_and(|s| s != i.revision) && canary_done;
    let fast = bakes(i.d) && (r.bake.is_some() || promotable);
    Some(Pace { every: if fast { scrapes::EVERY } else { scrapes::SERVING_EVERY }, quiet: quiet(i.d) })
}

/// How long a serving pod's counters must hold still after they grew before the deployment is
/// no longer Degraded for them: the bake's window (the time a revision is trusted on), 300 s
/// when the bake is off, at most an hour.
pub fn quiet(d: &crate::crd::InferenceDeployment) -> Duration {
    let s = d.spec.rollout.bake_seconds;
    Duration::from_secs(if s == 0 { 300 } else { s.min(3600) })
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
    match judge(&b, i.world.mismatches.as_ref(), &i.world.mismatches_by_pod, rollout.max_handoff_mismatches, rollout.bake_seconds, i.now) {
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
            r.roll_back(&b.revision, reason, &message);
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

/// Judges one pass of a bake: `mismatches` are the deployment's pods' counters now, summed by
/// name (`None`: none could be read yet), `by_pod` those of each pod that counted any.
pub(super) fn judge(b: &BakeStatus, mismatches: Option<&Counts>, by_pod: &BTreeMap<String, Counts>, max: u64, seconds: u64, now: &Time) -> BakeOutcome {
    let new = mismatches.map_or(0, |m| total(m).saturating_sub(b.mismatches_at_start));
    if new > max {
        let pods: Vec<String> = by_pod.iter().map(|(pod, n)| format!("pod {pod}: {}", integrity::describe(n))).collect();
        return BakeOutcome::RollBack(format!(
            "{new} handoff mismatches during the bake of revision {} (more than maxHandoffMismatches {max}; counters by reason: {}; {}); revision {} serves again",
            b.revision,
            mismatches.map(integrity::describe).unwrap_or_default(),
            pods.join("; "),
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
        let pods = |checksum: u64| BTreeMap::from([("llm-decode-r2-0".to_string(), counts(checksum))]);
        assert_eq!(judge(&bake(), Some(&counts(0)), &pods(0), 0, 300, &at(1010)), BakeOutcome::Continue, "the counts it started with are not new");
        assert_eq!(judge(&bake(), None, &BTreeMap::new(), 0, 300, &at(1010)), BakeOutcome::Continue);
        assert_eq!(judge(&bake(), Some(&counts(1)), &pods(1), 1, 300, &at(1010)), BakeOutcome::Continue, "one allowed");
        let BakeOutcome::RollBack(why) = judge(&bake(), Some(&counts(2)), &pods(2), 1, 300, &at(1010)) else { panic!() };
        assert_eq!(
            why,
            "2 handoff mismatches during the bake of revision r2 (more than maxHandoffMismatches 1; counters by reason: checksum 2, timeout 2; pod llm-decode-r2-0: checksum 2, timeout 2); revision r1 serves again"
        );
        assert_eq!(judge(&bake(), Some(&counts(0)), &pods(0), 0, 300, &at(1300)), BakeOutcome::Done);
    }

    #[test]
    fn a_counter_that_went_down_a_pod_restart_is_no_mismatch() {
        let counts = BTreeMap::from([("timeout".to_string(), 1)]);
        assert_eq!(judge(&bake(), Some(&counts), &BTreeMap::new(), 0, 300, &at(1010)), BakeOutcome::Continue);
    }

    /// A disaggregated vLLM's bake is judged on what its own pods count: a decode's NIXL
    /// failures, read from its `/metrics` as the scrape reads them, roll the revision back and
    /// the message names the pod and the counter.
    #[test]
    fn a_vllm_bake_rolls_back_on_the_engines_own_counters() {
        let spec = super::super::tests::vllm_pd().spec;
        let counters = spec.engine().integrity_counters(&spec);
        let decode = integrity::read(include_str!("../../engines/testdata/vllm-decode-metrics-integrity.txt"), counters);
        let pods = BTreeMap::from([("vllm-pd-decode-r2-0".to_string(), decode.clone())]);
        let b = BakeStatus { mismatches_at_start: 0, ..bake() };
        let BakeOutcome::RollBack(why) = judge(&b, Some(&decode), &pods, 0, 300, &at(1010)) else { panic!("6 counted, 0 allowed") };
        assert!(
            why.contains("6 handoff mismatches") && why.contains("pod vllm-pd-decode-r2-0: checksum 2, late 1, vllm:nixl_num_failed_transfers_total 3"),
            "{why}"
        );
        // One vLLM server moves no KV between pods: nothing to count, no bake.
        let single = crate::crd::InferenceDeploymentSpec { prefill: None, ..spec };
        assert!(single.engine().integrity_counters(&single).is_empty());
    }
}
