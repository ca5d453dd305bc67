//! `kubectl kvgate why NAME` and `kubectl kvgate list`: what a user reads when a deployment is
//! not simply Available. Pure: the deployment, its pods and its Events in, text out; the plugin
//! (`src/bin/kubectl-kvgate.rs`) fetches them with the user's own kubeconfig.

use std::fmt::Write;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;

use crate::conditions::{DEGRADED, PROGRESSING};
use crate::crd::{InferenceDeployment, InferenceDeploymentStatus, RoleStatus};
use crate::rollout_state::Phase;
use crate::{gate, labels};

/// How many of the deployment's Events `why` prints (the newest).
const EVENTS: usize = 5;

/// The explanation of one deployment: its phase and reason, the revision refused or degraded
/// with the operator's message, each pod's gate against the window, the newest Events, and what
/// to change.
pub fn explain(d: &InferenceDeployment, pods: &[Pod], events: &[Event]) -> String {
    let status = d.status.clone().unwrap_or_default();
    let phase = status.phase.map_or("Pending", |p| p.as_str());
    let mut out = String::new();
    let _ = writeln!(out, "{} ({} engine, contextWindow {}): {phase}{}", d.name_any(), d.spec.engine.as_str(), d.spec.context_window, bracketed(&status));
    let _ = match (&status.current_revision, status.current_context_window) {
        (Some(rev), Some(window)) => writeln!(out, "serving: revision {rev}, verified for contextWindow {window}"),
        _ => writeln!(out, "serving: no revision has passed the rollout gate"),
    };
    if let Some(r) = &status.refused_revision {
        let _ = writeln!(out, "refused: revision {} ({}): {}", r.revision, r.reason, r.message);
    }
    for (type_, label) in [(DEGRADED, "degraded"), (PROGRESSING, "progressing")] {
        if let Some(c) = status.conditions.iter().find(|c| c.type_ == type_ && c.status == "True") {
            let _ = writeln!(out, "{label}: {} ({})", c.message, c.reason);
        }
    }
    let pools: Vec<String> = [("prefill", &status.prefill), ("decode", &status.decode), ("server", &status.server)]
        .into_iter()
        .filter_map(|(role, s)| Some(format!("{role} {}", s.as_ref().and_then(|s: &RoleStatus| s.min_measured_tokens)?)))
        .collect();
    if !pools.is_empty() {
        let _ = writeln!(out, "smallest measured pools: {} (tokens one request may use; the window is {})", pools.join(", "), d.spec.context_window);
    }
    let _ = writeln!(out, "pods:");
    if pods.is_empty() {
        let _ = writeln!(out, "  none");
    }
    for p in pods {
        let _ = writeln!(out, "  {}", pod_line(p));
    }
    let mut mine: Vec<&Event> = events.iter().filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(d.name_any().as_str())).collect();
    mine.sort_by_key(|e| last_seen(e));
    let _ = writeln!(out, "events (newest last):");
    if mine.is_empty() {
        let _ = writeln!(out, "  none");
    }
    for e in mine.iter().rev().take(EVENTS).rev() {
        let _ = writeln!(out, "  {} {}: {}", e.type_.as_deref().unwrap_or("Normal"), e.reason.as_deref().unwrap_or(""), e.note.as_deref().unwrap_or("").trim());
    }
    let _ = writeln!(out, "to change: {}", advice(d, &status));
    out
}

/// ` (REASON)` when the status carries one.
fn bracketed(status: &InferenceDeploymentStatus) -> String {
    status.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
}

/// `NAME ROLE revision REV: GATE-STATUS REASON: message`, or the container's waiting reason.
fn pod_line(p: &Pod) -> String {
    let role = p.labels().get(labels::COMPONENT).cloned().unwrap_or_default();
    // kvgate's own router runs outside the revisions: it has none.
    let revision = p.labels().get(labels::REVISION).map(|r| format!(" revision {r}")).unwrap_or_default();
    let head = format!("{} {role}{revision}", p.name_any());
    let status = p.status.as_ref();
    let waiting = status.and_then(|s| s.container_statuses.as_ref()).into_iter().flatten().find_map(|c| c.state.as_ref()?.waiting.clone());
    if let Some(w) = waiting {
        return format!("{head}: waiting {}: {}", w.reason.unwrap_or_default(), w.message.unwrap_or_default());
    }
    let gate = status.and_then(|s| s.conditions.as_ref()).into_iter().flatten().find(|c| c.type_ == gate::CONDITION);
    match gate {
        Some(c) => format!(
            "{head}: gate {} {}: {}",
            if c.status == "True" { "passed" } else { "closed" },
            c.reason.as_deref().unwrap_or(""),
            c.message.as_deref().unwrap_or("")
        ),
        // A router of kvgate's own runs outside the revisions and is never gated.
        None => format!("{head}: {}", status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending")),
    }
}

fn last_seen(e: &Event) -> String {
    let series = e.series.as_ref().map(|s| s.last_observed_time.0.to_string());
    series
        .or_else(|| e.event_time.as_ref().map(|t| t.0.to_string()))
        .or_else(|| e.deprecated_last_timestamp.as_ref().map(|t| t.0.to_string()))
        .unwrap_or_default()
}

/// The one thing to change, by the reason the status gives.
pub fn advice(d: &InferenceDeployment, status: &InferenceDeploymentStatus) -> String {
    let window = d.spec.context_window;
    let smallest = status.min_measured_tokens.map_or(String::new(), |n| format!(", or lower spec.contextWindow to at most {n}"));
    match status.reason.as_deref() {
        None => "nothing: it serves every pod it runs".into(),
        Some("KVPoolBelowContextWindow") => format!(
            "give every pod a KV pool of at least {window} tokens for one request (kvgate: spec.<role>.kvPool.tokens or more memory; vLLM: --max-model-len and --gpu-memory-utilization; llama.cpp: -c per slot, i.e. -c / -np, or --kv-unified; SGLang: --max-total-tokens){smallest}; any spec change is a new attempt"
        ),
        Some("FingerprintMismatch") => "run one model and one KV layout (dtype, page size) on prefill and decode".into(),
        Some("CanaryFailed") => "the message names the pair or pod and the first token that differs: undo what this revision changed (image, flags, KV dtype) and apply again".into(),
        Some("BoundaryProbeAnswered") => {
            "make the engine refuse a prompt past the window with a 4xx (llama.cpp: --no-context-shift; no truncation of prompts), then apply again".into()
        }
        Some("HandoffIntegrityViolation") => "a pod counted KV that moved wrong (the counters are named above): fix the transfer path (network, the engine's KV connector, its lease) and apply again; the previous revision keeps serving".into(),
        Some("HostPathNotAllowed") => "use a persistentVolumeClaim instead of the hostPath the message names, or have the operator's administrator allow the directory (chart value allowedHostPaths)".into(),
        Some("ServingPodUnverified") => "the pod named above no longer holds the window (it restarted smaller, or with other fingerprints): restore its memory or flags, or delete it so its Deployment replaces it; the other pods keep serving".into(),
        Some("HandoffMismatchesCounted") => "each handoff counted above was refused, never decoded from, but its request failed: look at the named pod's transfer path (its node's network, the KV connector's log: kubectl logs POD), or delete the pod so its Deployment replaces it; the condition clears once its counters hold still".into(),
        Some("PodsCannotStart") => "the pod's own reason is named above (image pull, missing Secret, scheduling): kubectl describe pod NAME".into(),
        Some("IntegrityCanary") => "nothing yet: the integrity canary runs before any pod takes traffic".into(),
        Some(_) => "nothing yet: the pods are starting and measuring their pools (a pod that never reports keeps the gate waiting: kubectl logs POD)".into(),
    }
}

/// One row per deployment: namespace, name, engine, window, each role's smallest pool, phase
/// and reason.
pub fn list(ds: &[InferenceDeployment]) -> String {
    let mut rows = vec![["NAMESPACE", "NAME", "ENGINE", "WINDOW", "PREFILL", "DECODE", "SERVER", "STATUS", "REASON"].map(String::from).to_vec()];
    for d in ds {
        let s = d.status.clone().unwrap_or_default();
        let pool = |r: &Option<RoleStatus>| r.as_ref().and_then(|r| r.min_measured_tokens).map_or("-".into(), |n| n.to_string());
        rows.push(vec![
            d.namespace().unwrap_or_default(),
            d.name_any(),
            d.spec.engine.as_str().into(),
            d.spec.context_window.to_string(),
            pool(&s.prefill),
            pool(&s.decode),
            pool(&s.server),
            s.phase.map_or("Pending", |p| p.as_str()).into(),
            s.reason.clone().unwrap_or_else(|| "-".into()),
        ]);
    }
    let widths: Vec<usize> = (0..rows[0].len()).map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for r in rows {
        let cells: Vec<String> = r.iter().zip(&widths).map(|(c, w)| format!("{c:w$}")).collect();
        let _ = writeln!(out, "{}", cells.join("   ").trim_end());
    }
    out
}

/// Whether `why` exits non-zero: the spec's revision is refused or rolled back, or a serving
/// pod is out of the Service.
pub fn unhealthy(d: &InferenceDeployment) -> bool {
    let phase = d.status.as_ref().and_then(|s| s.phase);
    matches!(phase, Some(Phase::Refused | Phase::RolledBack | Phase::Degraded))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conditions::ROLLOUT_REFUSED;
    use crate::crd::RefusedRevision;
    use crate::rollout_state::RefusalReason;

    fn incident() -> InferenceDeployment {
        let mut d = InferenceDeployment::for_test(serde_json::json!({
            "model": { "name": "tiny" }, "contextWindow": 1048576,
            "prefill": { "replicas": 1, "kvPool": { "tokens": 8192 } }, "decode": { "replicas": 1, "kvPool": { "tokens": 8192 } },
        }));
        d.status = Some(InferenceDeploymentStatus {
            phase: Some(Phase::Refused),
            reason: Some("KVPoolBelowContextWindow".into()),
            refused_revision: Some(RefusedRevision {
                revision: "r1".into(),
                reason: RefusalReason::KVPoolBelowContextWindow,
                message: "prefill pod llm-prefill-r1-0 measured 681280 tokens < contextWindow 1048576".into(),
                rolled_back: false,
            }),
            conditions: vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                type_: ROLLOUT_REFUSED.into(),
                status: "True".into(),
                reason: "KVPoolBelowContextWindow".into(),
                message: "revision r1: ...".into(),
                last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
                observed_generation: None,
            }],
            prefill: Some(RoleStatus { revision: Some("r1".into()), min_measured_tokens: Some(681_280), ..Default::default() }),
            min_measured_tokens: Some(681_280),
            ..Default::default()
        });
        d
    }

    #[test]
    fn a_refusal_is_explained_with_both_numbers_and_what_to_change() {
        let d = incident();
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": { "name": "llm-prefill-r1-0", "labels": { labels::COMPONENT: "prefill", labels::REVISION: "r1" } },
            "status": { "conditions": [{ "type": gate::CONDITION, "status": "False", "reason": "KVPoolBelowContextWindow",
                "message": "prefill pod llm-prefill-r1-0 measured 681280 tokens < contextWindow 1048576" }] },
        }))
        .unwrap();
        let event: Event = serde_json::from_value(serde_json::json!({
            "metadata": { "name": "e" }, "eventTime": "2026-12-06T20:00:00.000000Z", "type": "Warning", "reason": "RolloutRefused",
            "note": "revision r1 refused: ...", "regarding": { "kind": "InferenceDeployment", "name": "llm" },
        }))
        .unwrap();
        let text = explain(&d, &[pod], &[event]);
        for want in [
            "llm (kvgate engine, contextWindow 1048576): Refused (KVPoolBelowContextWindow)",
            "serving: no revision has passed the rollout gate",
            "refused: revision r1 (KVPoolBelowContextWindow): prefill pod llm-prefill-r1-0 measured 681280 tokens < contextWindow 1048576",
            "smallest measured pools: prefill 681280",
            "llm-prefill-r1-0 prefill revision r1: gate closed KVPoolBelowContextWindow: prefill pod",
            "Warning RolloutRefused: revision r1 refused",
            "or lower spec.contextWindow to at most 681280",
        ] {
            assert!(text.contains(want), "no {want:?} in:\n{text}");
        }
        assert!(unhealthy(&d));
        let table = list(&[d]);
        let row: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(row, ["ns", "llm", "kvgate", "1048576", "681280", "-", "-", "Refused", "KVPoolBelowContextWindow"], "{table}");
    }

    #[test]
    fn every_reason_the_status_can_show_gets_advice_of_its_own() {
        let d = incident();
        let generic = advice(&d, &InferenceDeploymentStatus { reason: Some("VerifyingKVPools".into()), ..Default::default() });
        for r in RefusalReason::ALL.iter().map(|r| r.as_str()).chain(["ServingPodUnverified", "PodsCannotStart", "IntegrityCanary"]) {
            let said = advice(&d, &InferenceDeploymentStatus { reason: Some(r.into()), ..Default::default() });
            assert_ne!(said, generic, "{r} has no advice of its own");
        }
    }
}
