//! One reconcile of an InferenceDeployment, as a pipeline: observe (reads only) -> decide (pure:
//! `decide.rs`, where the refuse/promote decision lives) -> apply (writes only) -> the integrity
//! canary, when decide asked for one (its result is the next pass's input).

use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};

use super::{Context, Error, apply, decide, event, observe};
use crate::canary::{self, CanaryRun};
use crate::crd::{InferenceDeployment, InferenceDeploymentStatus};
use crate::render::revision;
use kvgate_proto::auth::DeploymentKey;

pub async fn reconcile(cached: &InferenceDeployment, ctx: &Context) -> Result<Action, Error> {
    let ns = cached.namespace().unwrap_or_else(|| "default".into());
    let Some(d) = observe::object(ctx, &ns, &cached.name_any()).await? else {
        return Ok(Action::await_change());
    };
    let image = d.spec.image.clone().unwrap_or_else(|| ctx.worker_image.clone());
    let rev = revision::of(&d.spec, &image);
    // A spec that would mount a node directory the operator may not mount gets no pod at all.
    let host_path_refusal = crate::host_paths::refusal(&d, &ctx.allowed_host_paths);
    let (world, key) = observe::world(ctx, &d).await?;

    let now = Time(Timestamp::now());
    let plan = decide::decide(decide::Inputs { d: &d, revision: &rev, host_path_refusal: host_path_refusal.as_deref(), world: &world, now: &now });

    apply::plan(ctx, &d, &image, &plan).await?;
    if let Some(run) = &plan.canary {
        canary(ctx, &d, &plan.status, run, key).await?;
        // The next pass acts on the result: gates opened, or the revision refused.
        return Ok(Action::requeue(Duration::from_millis(100)));
    }
    Ok(Action::requeue(if plan.settled { Duration::from_secs(30) } else { Duration::from_secs(2) }))
}

/// Runs the integrity canary on the candidate's pods (still not Ready: no traffic reaches them)
/// and records what it found in `status.canary`.
async fn canary(
    ctx: &Context,
    d: &InferenceDeployment,
    status: &InferenceDeploymentStatus,
    run: &CanaryRun,
    key: Result<DeploymentKey, String>,
) -> Result<(), Error> {
    let ns = d.namespace().unwrap_or_else(|| "default".into());
    let result = match key {
        Ok(key) => {
            tracing::info!(name = d.name_any(), %ns, revision = run.revision, pairs = run.prefill.len() * run.decode.len(), "integrity canary");
            let started = Instant::now();
            let result = canary::run(&ctx.http, &key, run).await;
            ctx.metrics.canary_duration.observe(started.elapsed().as_secs_f64());
            result
        }
        // Without the secret nothing can be signed; the pools were verified with it, so this is
        // transient (deleted meanwhile): retried, not a verdict on the revision.
        Err(why) => return Err(Error::Canary(why)),
    };
    ctx.metrics.canaries.with_label_values(&[if result.passed { "passed" } else { "failed" }]).inc();
    let (kind, reason) = if result.passed { (EventType::Normal, "CanaryPassed") } else { (EventType::Warning, "CanaryFailed") };
    event(ctx, &d.object_ref(&()), kind, reason, "IntegrityCanary", format!("revision {}: {}", run.revision, result.message)).await;
    apply::status(ctx, d, &InferenceDeploymentStatus { canary: Some(result), ..status.clone() }).await
}
