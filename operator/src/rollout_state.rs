//! The closed sets of rollout state: the phase an InferenceDeployment shows (`status.phase`, the
//! printer column, `kvgate_operator_rollout_phase`), why a revision is refused
//! (`status.refusedRevision.reason`, the `RolloutRefused` condition, the refusal metrics) and why
//! a promoted one is rolled back. Each serializes to its variant's name; the CRD schema lists the
//! variants and metric label sets come from `ALL`, so a new variant cannot be forgotten in
//! either (or left set when it should be cleared).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

macro_rules! closed_set {
    ($t:ty) => {
        impl $t {
            pub const ALL: &'static [$t] = <$t as strum::VariantArray>::VARIANTS;

            pub fn as_str(self) -> &'static str {
                self.into()
            }
        }

        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

// Variants carry `//` comments, not doc comments: schemars would turn documented variants into
// a `oneOf`, which a structural CRD schema cannot hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema, strum::IntoStaticStr, strum::VariantArray)]
pub enum Phase {
    // The spec's revision is being verified (pods starting, pools measured).
    Progressing,
    // Every pool of the candidate is verified; the integrity canary runs before any traffic.
    Canary,
    // Promoted; the previous revision is kept beside it while mismatch counters are watched.
    Baking,
    // The spec's revision serves.
    Available,
    // The spec's revision serves, but a serving pod is out of the Service (it fails the gate
    // or cannot start), or counted KV that moved wrong: condition Degraded says which and why.
    Degraded,
    // A baked revision broke handoffs and the previous one serves again.
    RolledBack,
    // The spec's revision stands refused.
    Refused,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema, strum::IntoStaticStr, strum::VariantArray)]
pub enum RefusalReason {
    // A pod measured a KV pool (per-request capacity) smaller than spec.contextWindow.
    KVPoolBelowContextWindow,
    // Prefill and decode pods report different model or KV layout fingerprints.
    FingerprintMismatch,
    // The integrity canary found a pair that failed, disagreed or counted a mismatch.
    CanaryFailed,
    // A pair or pod answered a prompt beyond spec.contextWindow instead of refusing it with a 4xx.
    BoundaryProbeAnswered,
    // Integrity counters moved: handoff mismatches (kvgate's, or an engine's own) during the canary, or past
    // spec.rollout.maxHandoffMismatches during the bake (rolled back).
    HandoffIntegrityViolation,
    // A hostPath volume (spec.model.volume or a role's volumes) is outside --allowed-host-paths; no pod was created.
    HostPathNotAllowed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema, strum::IntoStaticStr, strum::VariantArray)]
pub enum RollbackReason {
    // More handoff mismatches during the bake than spec.rollout.maxHandoffMismatches.
    HandoffIntegrityViolation,
}

// Other closed sets of the operator (`reasons::EventAction`) use it too.
pub(crate) use closed_set;

closed_set!(Phase);
closed_set!(RefusalReason);
closed_set!(RollbackReason);

impl From<RollbackReason> for RefusalReason {
    /// A rolled-back revision stands refused for the same reason.
    fn from(r: RollbackReason) -> Self {
        match r {
            RollbackReason::HandoffIntegrityViolation => RefusalReason::HandoffIntegrityViolation,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_serialize_to_their_names_and_the_schema_lists_them_all() {
        for p in Phase::ALL {
            assert_eq!(serde_json::to_value(p).unwrap(), p.as_str());
        }
        let schema = serde_json::to_value(schemars::schema_for!(Phase)).unwrap();
        let listed: Vec<&str> = schema["enum"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        assert_eq!(listed, Phase::ALL.iter().map(|p| p.as_str()).collect::<Vec<_>>());
    }

    #[test]
    fn every_rollback_reason_is_a_refusal_reason_of_the_same_name() {
        for r in RollbackReason::ALL {
            assert_eq!(RefusalReason::from(*r).as_str(), r.as_str());
        }
        assert_eq!(serde_json::to_value(RefusalReason::KVPoolBelowContextWindow).unwrap(), "KVPoolBelowContextWindow");
        assert_eq!(RefusalReason::ALL.len(), 6);
    }
}
