//! The readiness gate on pods: read each pod's capacity report, judge the revision, and set
//! the `kvgate.dev/kv-pool-verified` condition on every pod that reported.

use std::collections::BTreeMap;

use futures::future::join_all;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;

use crate::capacity;
use crate::gate::{self, PodReport, PodVerdict, Role, Verdict};
use crate::render::{DECODE_PORT, PREFILL_PORT, labels};

/// What the gate found for one revision.
#[derive(Debug, Clone)]
pub struct Verification {
    pub verdict: Verdict,
    /// Per role: pods that passed, and the smallest measured pool of those that reported.
    pub verified: BTreeMap<Role, i32>,
    pub min_measured: BTreeMap<Role, u64>,
    /// Pods that exist (not terminating), per role.
    pub pods: BTreeMap<Role, i32>,
}

/// Lists the revision's pods, reads their reports and sets their gate conditions.
pub async fn verify(pods_api: &Api<Pod>, http: &reqwest::Client, name: &str, revision: &str, context_window: u64) -> kube::Result<Verification> {
    let mut found: Vec<(Role, Pod)> = Vec::new();
    for role in [Role::Prefill, Role::Decode] {
        let lp = ListParams::default().labels(&labels::selector_string(&labels::revision_selector(name, role.as_str(), revision)));
        for pod in pods_api.list(&lp).await? {
            if pod.metadata.deletion_timestamp.is_none() {
                found.push((role, pod));
            }
        }
    }
    let reports = join_all(found.iter().map(|(role, pod)| async move {
        let ip = pod.status.as_ref().and_then(|s| s.pod_ip.clone());
        let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        let report = match ip.filter(|_| running) {
            Some(ip) => capacity::read(http, &ip, if *role == Role::Prefill { PREFILL_PORT } else { DECODE_PORT }).await.ok(),
            None => None,
        };
        PodReport { role: *role, pod: pod.metadata.name.clone().unwrap_or_default(), report }
    }))
    .await;
    let (verdicts, verdict) = gate::judge(context_window, &reports);
    let mut v = Verification { verdict, verified: BTreeMap::new(), min_measured: BTreeMap::new(), pods: BTreeMap::new() };
    for ((role, pod), (report, pod_verdict)) in found.iter().zip(reports.iter().zip(&verdicts)) {
        *v.pods.entry(*role).or_default() += 1;
        if let Some(r) = &report.report {
            let m = v.min_measured.entry(*role).or_insert(u64::MAX);
            *m = (*m).min(r.capacity_tokens);
        }
        if matches!(pod_verdict, PodVerdict::Verified { .. }) {
            *v.verified.entry(*role).or_default() += 1;
        }
        set_condition(pods_api, pod, pod_verdict).await?;
    }
    Ok(v)
}

/// Writes the pod's gate condition when it differs from what the pod has.
async fn set_condition(api: &Api<Pod>, pod: &Pod, verdict: &PodVerdict) -> kube::Result<()> {
    let (status, reason, message) = match verdict {
        PodVerdict::Pending => ("False", "AwaitingCapacityReport", "waiting for the pod's KV pool report (and the other role's fingerprints)".to_string()),
        PodVerdict::Verified { message } => ("True", "KVPoolVerified", message.clone()),
        PodVerdict::Failed { failure, message } => ("False", failure.reason(), message.clone()),
    };
    let existing = pod.status.as_ref().and_then(|s| s.conditions.as_ref()).and_then(|cs| cs.iter().find(|c| c.type_ == gate::CONDITION));
    if existing.is_some_and(|c| c.status == status && c.reason.as_deref() == Some(reason) && c.message.as_deref() == Some(message.as_str())) {
        return Ok(());
    }
    let since = existing.filter(|c| c.status == status).and_then(|c| c.last_transition_time.clone()).unwrap_or_else(|| Time(Timestamp::now()));
    let patch = json!({ "status": { "conditions": [{
        "type": gate::CONDITION, "status": status, "reason": reason, "message": message, "lastTransitionTime": since,
    }]}});
    let name = pod.metadata.name.clone().unwrap_or_default();
    // Strategic merge keys conditions by type: the kubelet's own conditions are left alone.
    api.patch_status(&name, &PatchParams::default(), &Patch::Strategic(patch)).await?;
    Ok(())
}
