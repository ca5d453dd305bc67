//! The rollout gate's decision: a revision's capacity reports in, a verdict per pod and one for
//! the revision out. Pure code, no I/O.

use kvgate_proto::CapacityReport;

/// The readiness gate the operator owns on every prefill and decode pod.
pub const CONDITION: &str = "kvgate.dev/kv-pool-verified";

pub use kvgate_proto::contract::Role;

/// One pod's capacity report (or none yet: still starting, or unreachable).
#[derive(Debug, Clone)]
pub struct PodReport {
    pub role: Role,
    pub pod: String,
    pub report: Option<CapacityReport>,
}

/// Why a pod fails the gate: the `reason` of its condition and of the refusal.
pub use crate::rollout_state::RefusalReason as Failure;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodVerdict {
    /// No report yet: the condition stays unset.
    Pending,
    Verified {
        message: String,
    },
    Failed {
        failure: Failure,
        message: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every pod reported and passed.
    Verified,
    /// Some pods have not reported; none failed.
    Pending,
    /// The first failing pod's reason and message.
    Refused { failure: Failure, message: String },
}

/// Judges every pod of one revision against `context_window`.
///
/// A pod passes when its measured pool holds the window and its model and layout fingerprints
/// equal those of the other role's pods (the pages decode stores must be the ones prefill
/// computes). With no pod of the other role reporting yet, the fingerprint check waits.
pub fn judge(context_window: u64, pods: &[PodReport]) -> (Vec<PodVerdict>, Verdict) {
    let fingerprints = |role: Role| -> Option<(&str, &str)> {
        pods.iter().filter(|p| p.role == role).find_map(|p| p.report.as_ref().map(|r| (r.model_fingerprint.as_str(), r.layout_fingerprint.as_str())))
    };
    let verdicts: Vec<PodVerdict> = pods
        .iter()
        .map(|p| {
            let Some(r) = &p.report else { return PodVerdict::Pending };
            let role = p.role.as_str();
            if r.capacity_tokens < context_window {
                return PodVerdict::Failed {
                    failure: Failure::KVPoolBelowContextWindow,
                    message: format!("{role} pod {} measured {} tokens < contextWindow {context_window}", p.pod, r.capacity_tokens),
                };
            }
            let other = p.role.peer();
            match fingerprints(other) {
                None => PodVerdict::Pending,
                Some((model, layout)) if model != r.model_fingerprint || layout != r.layout_fingerprint => PodVerdict::Failed {
                    failure: Failure::FingerprintMismatch,
                    message: format!(
                        "{role} pod {} has model/layout fingerprints {}/{} but the {} pods have {model}/{layout}",
                        p.pod,
                        r.model_fingerprint,
                        r.layout_fingerprint,
                        other.as_str()
                    ),
                },
                Some(_) => {
                    PodVerdict::Verified { message: format!("{role} pod {} measured {} tokens >= contextWindow {context_window}", p.pod, r.capacity_tokens) }
                }
            }
        })
        .collect();
    let verdict = if let Some((failure, message)) = verdicts.iter().find_map(|v| match v {
        PodVerdict::Failed { failure, message } => Some((*failure, message.clone())),
        _ => None,
    }) {
        Verdict::Refused { failure, message }
    } else if !pods.is_empty() && verdicts.iter().all(|v| matches!(v, PodVerdict::Verified { .. })) {
        Verdict::Verified
    } else {
        Verdict::Pending
    };
    (verdicts, verdict)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(tokens: u64, model: &str, layout: &str) -> Option<CapacityReport> {
        Some(CapacityReport {
            capacity_tokens: tokens,
            page_size: 16,
            num_pages: tokens / 16,
            bytes_per_token: 512,
            device: "cpu".into(),
            dtype: "bf16".into(),
            model: "tiny".into(),
            model_fingerprint: model.into(),
            layout_fingerprint: layout.into(),
            vocab_size: Some(258),
        })
    }

    fn pod(role: Role, name: &str, report: Option<CapacityReport>) -> PodReport {
        PodReport { role, pod: name.into(), report }
    }

    #[test]
    fn the_incident_is_refused_with_both_numbers() {
        let pods = [pod(Role::Prefill, "p-0", report(681_280, "m", "l")), pod(Role::Decode, "d-0", report(2_000_000, "m", "l"))];
        let (per_pod, verdict) = judge(1_048_576, &pods);
        assert_eq!(
            verdict,
            Verdict::Refused { failure: Failure::KVPoolBelowContextWindow, message: "prefill pod p-0 measured 681280 tokens < contextWindow 1048576".into() }
        );
        assert!(matches!(per_pod[1], PodVerdict::Verified { .. }), "{per_pod:?}");
    }

    #[test]
    fn a_pool_exactly_the_window_passes() {
        let pods = [pod(Role::Prefill, "p", report(4096, "m", "l")), pod(Role::Decode, "d", report(4096, "m", "l"))];
        assert_eq!(judge(4096, &pods).1, Verdict::Verified);
        assert!(matches!(judge(4097, &pods).1, Verdict::Refused { failure: Failure::KVPoolBelowContextWindow, .. }));
    }

    #[test]
    fn fingerprints_must_agree_across_roles() {
        let pods = [pod(Role::Prefill, "p", report(4096, "m", "l-bf16")), pod(Role::Decode, "d", report(4096, "m", "l-f32"))];
        let (_, verdict) = judge(1024, &pods);
        let Verdict::Refused { failure, message } = verdict else { panic!("{verdict:?}") };
        assert_eq!(failure, Failure::FingerprintMismatch);
        assert!(message.contains("l-bf16") && message.contains("l-f32"), "{message}");
    }

    #[test]
    fn waiting_pods_keep_the_revision_pending_until_a_failure() {
        let pods = [pod(Role::Prefill, "p", report(4096, "m", "l")), pod(Role::Decode, "d", None)];
        let (per_pod, verdict) = judge(1024, &pods);
        assert_eq!(verdict, Verdict::Pending);
        // Without a decode report there is nothing to compare fingerprints with yet.
        assert_eq!(per_pod, vec![PodVerdict::Pending, PodVerdict::Pending]);
        // A too-small pool fails at once, whatever the other pods do.
        let pods = [pod(Role::Prefill, "p", report(512, "m", "l")), pod(Role::Decode, "d", None)];
        assert!(matches!(judge(1024, &pods).1, Verdict::Refused { .. }));
        assert_eq!(judge(1024, &[]).1, Verdict::Pending);
    }
}
