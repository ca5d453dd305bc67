//! The rollout gate's decision: a revision's capacity reports in, a verdict per pod and one for
//! the revision out. Pure code, no I/O.

use kvgate_proto::CapacityReport;

use crate::engines::EngineCapacity;

/// The readiness gate the operator owns on every prefill and decode pod.
pub const CONDITION: &str = "kvgate.dev/kv-pool-verified";

pub use crate::role::Role;

/// What a pod measured: a kvgate worker's signed capacity report, or what an external engine
/// says one request may use.
#[derive(Debug, Clone, PartialEq)]
pub enum Measured {
    Kvgate(CapacityReport),
    Engine(EngineCapacity),
}

impl Measured {
    /// Tokens one request may use.
    pub fn tokens(&self) -> u64 {
        match self {
            Measured::Kvgate(r) => r.capacity_tokens,
            Measured::Engine(c) => c.tokens,
        }
    }

    /// Model and KV-layout fingerprints (kvgate's workers only).
    pub fn fingerprints(&self) -> Option<(&str, &str)> {
        match self {
            Measured::Kvgate(r) => Some((&r.model_fingerprint, &r.layout_fingerprint)),
            Measured::Engine(_) => None,
        }
    }

    /// `prefill pod P measured N tokens`, `llamacpp pod P: n_ctx per slot N` or, for a role of
    /// a disaggregated engine, `sglang prefill pod P: max_total_num_tokens N`.
    fn describe(&self, role: Role, pod: &str) -> String {
        match self {
            Measured::Kvgate(r) => format!("{} pod {pod} measured {} tokens", role.as_str(), r.capacity_tokens),
            Measured::Engine(c) if role == Role::Server => format!("{} pod {pod}: {} {}", c.engine.as_str(), c.field, c.tokens),
            Measured::Engine(c) => format!("{} {} pod {pod}: {} {}", c.engine.as_str(), role.as_str(), c.field, c.tokens),
        }
    }
}

/// One pod's capacity (or none yet: still starting, or unreachable).
#[derive(Debug, Clone)]
pub struct PodReport {
    pub role: Role,
    pub pod: String,
    pub report: Option<Measured>,
    /// What the serving probes caught the pod answering: it fails whatever its pool holds.
    pub caught: Option<(Failure, String)>,
    /// Its containers pass their own readiness probes (`ContainersReady`). A router is judged
    /// on it: one still waiting for its workers must not be asked by the canary.
    pub containers_ready: bool,
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
pub enum RevisionVerdict {
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
pub fn judge(context_window: u64, pods: &[PodReport]) -> (Vec<PodVerdict>, RevisionVerdict) {
    let fingerprints = |role: Role| -> Option<(&str, &str)> { pods.iter().filter(|p| p.role == role).find_map(|p| p.report.as_ref()?.fingerprints()) };
    let mut verdicts: Vec<PodVerdict> = pods
        .iter()
        .map(|p| {
            if let Some((failure, message)) = &p.caught {
                return PodVerdict::Failed { failure: *failure, message: message.clone() };
            }
            let Some(r) = &p.report else { return PodVerdict::Pending };
            let measured = r.describe(p.role, &p.pod);
            if r.tokens() < context_window {
                return PodVerdict::Failed { failure: Failure::KVPoolBelowContextWindow, message: format!("{measured} < contextWindow {context_window}") };
            }
            let verified = PodVerdict::Verified { message: format!("{measured} >= contextWindow {context_window}") };
            // Prefill and decode exchange pages: their fingerprints must agree.
            let (Some(other), Some((own_model, own_layout))) = (p.role.peer(), r.fingerprints()) else { return verified };
            match fingerprints(other) {
                None => PodVerdict::Pending,
                Some((model, layout)) if model != own_model || layout != own_layout => PodVerdict::Failed {
                    failure: Failure::FingerprintMismatch,
                    message: format!(
                        "{} pod {} has model/layout fingerprints {own_model}/{own_layout} but the {} pods have {model}/{layout}",
                        p.role.as_str(),
                        p.pod,
                        other.as_str()
                    ),
                },
                Some(_) => verified,
            }
        })
        .collect();
    // A router holds no KV: it passes once every pod it routes to has and it answers itself.
    let routed: Vec<&PodVerdict> = pods.iter().zip(&verdicts).filter(|(p, _)| p.role.holds_kv()).map(|(_, v)| v).collect();
    if !routed.is_empty() && routed.iter().all(|v| matches!(v, PodVerdict::Verified { .. })) {
        let message = format!("routes to {} verified pods of its revision", routed.len());
        for (p, v) in pods.iter().zip(verdicts.iter_mut()) {
            if !p.role.holds_kv() && p.containers_ready {
                *v = PodVerdict::Verified { message: message.clone() };
            }
        }
    }
    let verdict = if let Some((failure, message)) = verdicts.iter().find_map(|v| match v {
        PodVerdict::Failed { failure, message } => Some((*failure, message.clone())),
        _ => None,
    }) {
        RevisionVerdict::Refused { failure, message }
    } else if !pods.is_empty() && verdicts.iter().all(|v| matches!(v, PodVerdict::Verified { .. })) {
        RevisionVerdict::Verified
    } else {
        RevisionVerdict::Pending
    };
    (verdicts, verdict)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(tokens: u64, model: &str, layout: &str) -> Option<Measured> {
        Some(Measured::Kvgate(CapacityReport {
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
            instance: String::new(),
            prefill_timings: None,
        }))
    }

    fn pod(role: Role, name: &str, report: Option<Measured>) -> PodReport {
        PodReport { role, pod: name.into(), report, caught: None, containers_ready: true }
    }

    #[test]
    fn the_incident_is_refused_with_both_numbers() {
        let pods = [pod(Role::Prefill, "p-0", report(681_280, "m", "l")), pod(Role::Decode, "d-0", report(2_000_000, "m", "l"))];
        let (per_pod, verdict) = judge(1_048_576, &pods);
        assert_eq!(
            verdict,
            RevisionVerdict::Refused {
                failure: Failure::KVPoolBelowContextWindow,
                message: "prefill pod p-0 measured 681280 tokens < contextWindow 1048576".into()
            }
        );
        assert!(matches!(per_pod[1], PodVerdict::Verified { .. }), "{per_pod:?}");
    }

    #[test]
    fn a_pool_exactly_the_window_passes() {
        let pods = [pod(Role::Prefill, "p", report(4096, "m", "l")), pod(Role::Decode, "d", report(4096, "m", "l"))];
        assert_eq!(judge(4096, &pods).1, RevisionVerdict::Verified);
        assert!(matches!(judge(4097, &pods).1, RevisionVerdict::Refused { failure: Failure::KVPoolBelowContextWindow, .. }));
    }

    #[test]
    fn fingerprints_must_agree_across_roles() {
        let pods = [pod(Role::Prefill, "p", report(4096, "m", "l-bf16")), pod(Role::Decode, "d", report(4096, "m", "l-f32"))];
        let (_, verdict) = judge(1024, &pods);
        let RevisionVerdict::Refused { failure, message } = verdict else { panic!("{verdict:?}") };
        assert_eq!(failure, Failure::FingerprintMismatch);
        assert!(message.contains("l-bf16") && message.contains("l-f32"), "{message}");
    }

    #[test]
    fn an_engine_pod_is_judged_on_its_own_numbers_named_as_the_engine_names_them() {
        let engine = |tokens: u64| {
            Some(Measured::Engine(EngineCapacity {
                engine: crate::crd::Engine::Llamacpp,
                tokens,
                field: "n_ctx per slot".into(),
                model: "tiny.gguf".into(),
                detail: "4 slots".into(),
            }))
        };
        let (per_pod, verdict) = judge(4096, &[pod(Role::Server, "s-0", engine(1024))]);
        assert_eq!(
            verdict,
            RevisionVerdict::Refused {
                failure: Failure::KVPoolBelowContextWindow,
                message: "llamacpp pod s-0: n_ctx per slot 1024 < contextWindow 4096".into()
            }
        );
        assert_eq!(per_pod.len(), 1);
        // No peer role, no fingerprints: a pool that holds the window is verified on its own.
        assert_eq!(judge(4096, &[pod(Role::Server, "s-0", engine(4096))]).1, RevisionVerdict::Verified);
    }

    #[test]
    fn a_disaggregated_engines_roles_are_named_and_its_router_waits_for_them() {
        let engine = |tokens: u64| {
            Some(Measured::Engine(EngineCapacity {
                engine: crate::crd::Engine::Sglang,
                tokens,
                field: "max_total_num_tokens".into(),
                model: "m".into(),
                detail: String::new(),
            }))
        };
        let pods = |prefill: u64| [pod(Role::Prefill, "p-0", engine(prefill)), pod(Role::Decode, "d-0", engine(2_000_000)), pod(Role::Router, "r-0", None)];
        let (per_pod, verdict) = judge(1_048_576, &pods(681_280));
        assert_eq!(
            verdict,
            RevisionVerdict::Refused {
                failure: Failure::KVPoolBelowContextWindow,
                message: "sglang prefill pod p-0: max_total_num_tokens 681280 < contextWindow 1048576".into()
            }
        );
        assert_eq!(per_pod[2], PodVerdict::Pending, "the router never passes over a refused pod");
        let (per_pod, verdict) = judge(1_048_576, &pods(1_048_576));
        assert_eq!(verdict, RevisionVerdict::Verified);
        assert_eq!(per_pod[2], PodVerdict::Verified { message: "routes to 2 verified pods of its revision".into() });
        // With one pod still unread the router waits too.
        let (per_pod, verdict) = judge(1024, &[pod(Role::Prefill, "p-0", engine(4096)), pod(Role::Decode, "d-0", None), pod(Role::Router, "r-0", None)]);
        assert_eq!((verdict, &per_pod[2]), (RevisionVerdict::Pending, &PodVerdict::Pending));
        // A router still waiting for its workers (vllm-router listens only once they answer)
        // keeps the revision pending: the canary would find nothing listening.
        let mut waiting = pods(1_048_576);
        waiting[2].containers_ready = false;
        let (per_pod, verdict) = judge(1_048_576, &waiting);
        assert_eq!((verdict, &per_pod[2]), (RevisionVerdict::Pending, &PodVerdict::Pending));
    }

    #[test]
    fn a_pod_the_probes_caught_fails_and_its_router_stops_passing() {
        let engine = |tokens: u64| {
            Some(Measured::Engine(EngineCapacity { engine: crate::crd::Engine::Sglang, tokens, field: "f".into(), model: "m".into(), detail: String::new() }))
        };
        let mut pods = [pod(Role::Prefill, "p-0", engine(4096)), pod(Role::Decode, "d-0", engine(4096)), pod(Role::Router, "r-0", None)];
        pods[1].caught = Some((Failure::CanaryFailed, "stale KV: ...".into()));
        let (per_pod, verdict) = judge(4096, &pods);
        assert_eq!(per_pod[1], PodVerdict::Failed { failure: Failure::CanaryFailed, message: "stale KV: ...".into() });
        assert_eq!(per_pod[2], PodVerdict::Pending, "a router in front of a caught pod does not pass");
        assert_eq!(verdict, RevisionVerdict::Refused { failure: Failure::CanaryFailed, message: "stale KV: ...".into() });
    }

    #[test]
    fn waiting_pods_keep_the_revision_pending_until_a_failure() {
        let pods = [pod(Role::Prefill, "p", report(4096, "m", "l")), pod(Role::Decode, "d", None)];
        let (per_pod, verdict) = judge(1024, &pods);
        assert_eq!(verdict, RevisionVerdict::Pending);
        // Without a decode report there is nothing to compare fingerprints with yet.
        assert_eq!(per_pod, vec![PodVerdict::Pending, PodVerdict::Pending]);
        // A too-small pool fails at once, whatever the other pods do.
        let pods = [pod(Role::Prefill, "p", report(512, "m", "l")), pod(Role::Decode, "d", None)];
        assert!(matches!(judge(1024, &pods).1, RevisionVerdict::Refused { .. }));
        assert_eq!(judge(1024, &[]).1, RevisionVerdict::Pending);
    }
}
