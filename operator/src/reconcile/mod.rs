//! The reconciler: level-triggered and idempotent. Every pass renders what the spec asks for,
//! applies it with one field manager (server-side apply: applying what is already there writes
//! nothing), runs the rollout gate on the candidate revision, and writes status when it changed.

pub mod apply;
pub mod pods;
pub mod rollout;
pub mod status;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Resource, ResourceExt};

use crate::crd::InferenceDeployment;
use crate::metrics::Metrics;

/// The field manager of everything the operator writes.
pub const MANAGER: &str = "kvgate-operator";

pub struct Context {
    pub client: kube::Client,
    pub http: reqwest::Client,
    pub metrics: Metrics,
    pub recorder: Recorder,
    pub worker_image: String,
    /// Node directories a hostPath model may be under (see `host_paths`).
    pub allowed_host_paths: Vec<String>,
    /// Consecutive failures per object, for the retry backoff.
    pub failures: Mutex<HashMap<String, u32>>,
}

impl Context {
    pub fn new(client: kube::Client, metrics: Metrics, recorder: Recorder, worker_image: String, allowed_host_paths: Vec<String>) -> Self {
        Context { client, http: crate::capacity::client(), metrics, recorder, worker_image, allowed_host_paths, failures: Mutex::default() }
    }
}

fn key(d: &InferenceDeployment) -> String {
    format!("{}/{}", d.namespace().unwrap_or_default(), d.name_any())
}

/// 1 s, 2 s, 4 s ... up to 256 s after consecutive failures.
pub fn backoff(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.saturating_sub(1).min(8))
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}: {source}")]
    Kube { what: String, source: kube::Error },
}

pub fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    move |source| Error::Kube { what, source }
}

pub async fn reconcile(d: Arc<InferenceDeployment>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = rollout::reconcile(&d, &ctx).await;
    if result.is_ok() {
        ctx.failures.lock().unwrap().remove(&key(&d));
    }
    ctx.metrics.reconcile_duration.observe(started.elapsed().as_secs_f64());
    ctx.metrics.reconciles.with_label_values(&[if result.is_ok() { "success" } else { "error" }]).inc();
    result
}

/// Failed reconciles are retried with exponential backoff and become Warning Events.
pub fn error_policy(d: Arc<InferenceDeployment>, err: &Error, ctx: Arc<Context>) -> Action {
    let failures = {
        let mut map = ctx.failures.lock().unwrap();
        let n = map.entry(key(&d)).or_insert(0);
        *n += 1;
        *n
    };
    let retry = backoff(failures);
    tracing::warn!(name = d.name_any(), namespace = d.namespace(), error = %err, failures, ?retry, "reconcile failed");
    let ctx = ctx.clone();
    let reference = d.object_ref(&());
    let note = err.to_string();
    tokio::spawn(async move { event(&ctx, &reference, EventType::Warning, "ReconcileError", "Reconcile", note).await });
    Action::requeue(retry)
}

pub async fn event(ctx: &Context, reference: &ObjectReference, type_: EventType, reason: &str, action: &str, note: String) {
    let ev = Event { type_, reason: reason.into(), note: Some(note), action: action.into(), secondary: None };
    if let Err(e) = ctx.recorder.publish(&ev, reference).await {
        tracing::warn!(error = %e, reason, "could not publish an event");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn backoff_doubles_up_to_256_seconds() {
        let secs: Vec<u64> = (1..=11).map(|n| super::backoff(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 64, 128, 256, 256, 256]);
    }
}
