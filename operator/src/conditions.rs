//! metav1.Condition bookkeeping: a condition's transition time moves only when its status does.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::reasons::Reason;

pub const AVAILABLE: &str = "Available";
pub const PROGRESSING: &str = "Progressing";
pub const CAPACITY_VERIFIED: &str = "CapacityVerified";
pub const ROLLOUT_REFUSED: &str = "RolloutRefused";
/// A pod of the serving revision no longer passes the gate (it is out of the EndpointSlices).
pub const DEGRADED: &str = "Degraded";
/// The prefill pods, at their measured rate, can prefill a prompt of the whole window before
/// the handoff deadline (longer prompts would be answered 504). Advisory: it refuses nothing.
pub const PREFILL_WITHIN_DEADLINE: &str = "PrefillWithinHandoffTimeout";

/// Sets `type_` in `conds`, keeping `lastTransitionTime` when the status is unchanged (`now`
/// when it changed: the pass's time, so a plan is a function of its inputs).
pub fn set(conds: &mut Vec<Condition>, type_: &str, status: bool, reason: Reason, message: String, generation: Option<i64>, now: &Time) {
    let status = if status { "True" } else { "False" }.to_string();
    let since = conds.iter().find(|c| c.type_ == type_ && c.status == status).map(|c| c.last_transition_time.clone()).unwrap_or_else(|| now.clone());
    conds.retain(|c| c.type_ != type_);
    conds.push(Condition {
        type_: type_.into(),
        status,
        reason: reason.as_str().into(),
        message,
        observed_generation: generation,
        last_transition_time: since,
    });
    conds.sort_by(|a, b| a.type_.cmp(&b.type_));
}

pub fn is_true(conds: &[Condition], type_: &str) -> bool {
    conds.iter().any(|c| c.type_ == type_ && c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transition_time_moves_only_with_the_status() {
        let at = |s: i64| Time(k8s_openapi::jiff::Timestamp::from_second(s).unwrap());
        let mut c = Vec::new();
        set(&mut c, AVAILABLE, false, Reason::AwaitingVerification, "a".into(), Some(1), &at(10));
        set(&mut c, AVAILABLE, false, Reason::NotEnoughReadyPods, "b".into(), Some(2), &at(20));
        assert_eq!(c[0].last_transition_time, at(10));
        assert_eq!((c[0].reason.as_str(), c[0].message.as_str()), ("NotEnoughReadyPods", "b"));
        set(&mut c, AVAILABLE, true, Reason::Serving, "c".into(), Some(2), &at(30));
        assert_eq!(c[0].last_transition_time, at(30));
        assert!(is_true(&c, AVAILABLE));
        assert_eq!(c.len(), 1);
    }
}
