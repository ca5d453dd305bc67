//! Every reason the operator writes on a condition of an InferenceDeployment, on a pod's gate
//! condition, or on an Event, and every Event's action, as closed sets with one spelling each. A refusal's reasons are
//! `RefusalReason` and a missing capacity report's `NoReportReason`; `Reason` carries them, so
//! every writer takes a `Reason` and no reason is a string literal at its use.

use crate::capacity::NoReportReason;
use crate::rollout_state::RefusalReason;

#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr)]
pub enum Reason {
    // Available
    Serving,
    AwaitingVerification,
    NotEnoughReadyPods,
    PodsCannotStart,
    // Progressing
    RolloutComplete,
    IntegrityCanary,
    VerifyingKVPools,
    // CapacityVerified, RolloutRefused and pod gates
    KVPoolVerified,
    AwaitingCapacityReports,
    AwaitingCanary,
    NotRefused,
    // Degraded
    ServingPodsVerified,
    ServingPodUnverified,
    HandoffMismatchesCounted,
    NoServingRevision,
    // PrefillWithinHandoffTimeout
    WithinHandoffTimeout,
    WindowExceedsHandoffTimeout,
    // Events only
    PrefillSlowerThanHandoffTimeout,
    CanaryPassed,
    RolloutVerified,
    BakeComplete,
    RolledBack,
    RolloutRefused,
    HandoffCountersQuiet,
    // InferencePoolReady
    Applied,
    #[strum(serialize = "CRDNotInstalled")]
    CrdNotInstalled,
    // A failed API call (reconcile errors' Events, the InferencePool's condition)
    Forbidden,
    Conflict,
    ObjectRejected,
    ApiUnavailable,
    // Carried sets
    Refused(RefusalReason),
    NoReport(NoReportReason),
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Refused(r) => r.as_str(),
            Reason::NoReport(r) => r.as_str(),
            plain => plain.into(),
        }
    }
}

/// What an Event says the operator was doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr, strum::VariantArray)]
pub enum EventAction {
    RolloutGate,
    IntegrityCanary,
    Bake,
    IntegrityWatch,
    HostPathPolicy,
    InferencePool,
    Reconcile,
}

crate::rollout_state::closed_set!(EventAction);

/// Compared with how it is spelled on the API (a condition or an Event read back).
impl PartialEq<&str> for Reason {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carried_reasons_keep_their_own_spelling_and_plain_ones_their_name() {
        assert_eq!(Reason::Refused(RefusalReason::CanaryFailed).as_str(), "CanaryFailed");
        assert_eq!(Reason::NoReport(NoReportReason::Awaiting).as_str(), "AwaitingCapacityReport");
        assert_eq!(Reason::CrdNotInstalled.as_str(), "CRDNotInstalled");
        assert_eq!(Reason::ServingPodUnverified.to_string(), "ServingPodUnverified");
    }
}
