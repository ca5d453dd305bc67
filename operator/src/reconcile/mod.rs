//! The reconciler: level-triggered and idempotent. Each pass is `rollout::reconcile`: observe
//! (reads the watch-fed stores and the background tasks' results; no API call, no wait) ->
//! decide (pure) -> build (pure: the plan as objects) -> apply (writes only what differs from
//! what the watches show).

pub mod apply;
pub mod build;
pub mod context;
pub mod decide;
pub mod inference_pool;
pub mod memory;
pub mod observe;
pub mod pod_problems;
pub mod pool_condition;
pub mod rollout;

use std::sync::Arc;
use std::time::Instant;
use tracing::Instrument;

use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};

use crate::crd::InferenceDeployment;
use crate::reasons::EventAction;

pub use context::{Context, Error, Settings, event};
pub use memory::Memory;

pub async fn reconcile(d: Arc<InferenceDeployment>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    // One trace per pass (observe, decide, apply as its children), when spans are exported.
    let span = tracing::info_span!(
        "reconcile",
        deployment = d.name_any(),
        namespace = d.namespace().unwrap_or_default(),
        revision = tracing::field::Empty,
        phase = tracing::field::Empty,
        rollback = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        otel.status_description = tracing::field::Empty,
            error.type = tracing::field::Empty,
    );
    let result = rollout::reconcile(&d, &ctx).instrument(span.clone()).await;
    if let Err(e) = &result {
        kvgate_telemetry::trace_context::mark_failed(&span, e.reason().as_str());
    }
    if result.is_ok() {
        ctx.memory.succeeded(&d);
    }
    ctx.metrics.reconcile_duration.observe(started.elapsed().as_secs_f64());
    ctx.metrics.reconciles.with_label_values(&[if result.is_ok() { "success" } else { "error" }]).inc();
    result
}

/// Failed reconciles are retried with exponential backoff and become Warning Events.
pub fn error_policy(d: Arc<InferenceDeployment>, err: &Error, ctx: Arc<Context>) -> Action {
    let failures = ctx.memory.failed(&d);
    if failures == 0 {
        // Deleted meanwhile: nothing to retry, nothing to announce.
        return Action::await_change();
    }
    let retry = err.retry_after(failures);
    tracing::warn!(name = d.name_any(), namespace = d.namespace(), error = %err, reason = err.reason().as_str(), failures, ?retry, "reconcile failed");
    let ctx = ctx.clone();
    let reference = d.object_ref(&());
    let note = err.to_string();
    let reason = err.reason();
    tokio::spawn(async move { event(&ctx, &reference, EventType::Warning, reason, EventAction::Reconcile, note).await });
    Action::requeue(retry)
}
