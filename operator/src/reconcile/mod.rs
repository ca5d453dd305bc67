//! The reconciler: level-triggered and idempotent. Every pass renders what the spec asks for,
//! applies it with one field manager (server-side apply: applying what is already there writes
//! nothing), runs the rollout gate on the candidate revision, and writes status when it changed.

pub mod apply;
pub mod pods;
pub mod rollout;
pub mod status;

use std::sync::Arc;
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
    ctx.metrics.reconcile_duration.observe(started.elapsed().as_secs_f64());
    ctx.metrics.reconciles.with_label_values(&[if result.is_ok() { "success" } else { "error" }]).inc();
    result
}

/// Failed reconciles are retried with backoff (the controller's) and become Warning Events.
pub fn error_policy(d: Arc<InferenceDeployment>, err: &Error, ctx: Arc<Context>) -> Action {
    tracing::warn!(name = d.name_any(), namespace = d.namespace(), error = %err, "reconcile failed");
    let ctx = ctx.clone();
    let reference = d.object_ref(&());
    let note = err.to_string();
    tokio::spawn(async move { event(&ctx, &reference, EventType::Warning, "ReconcileError", "Reconcile", note).await });
    Action::requeue(Duration::from_secs(5))
}

pub async fn event(ctx: &Context, reference: &ObjectReference, type_: EventType, reason: &str, action: &str, note: String) {
    let ev = Event { type_, reason: reason.into(), note: Some(note), action: action.into(), secondary: None };
    if let Err(e) = ctx.recorder.publish(&ev, reference).await {
        tracing::warn!(error = %e, reason, "could not publish an event");
    }
}
