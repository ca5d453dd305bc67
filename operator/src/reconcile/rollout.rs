//! One reconcile of an InferenceDeployment, as a pipeline: observe (the stores and the
//! background tasks; no API call, no wait) -> decide (pure: `decide/`) -> apply (writes only
//! differences) -> start what the plan asks to run in the background (the integrity canary).

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use tracing::Instrument;

use super::context::{Context, Error};
use super::{apply, decide, observe};
use crate::crd::InferenceDeployment;
use crate::render::revision;

pub async fn reconcile(cached: &InferenceDeployment, ctx: &Context) -> Result<Action, Error> {
    // Being deleted, or deleted already (its index entry is gone): nothing to write.
    if cached.metadata.deletion_timestamp.is_some() || !ctx.index.contains(&cached.uid().unwrap_or_default()) {
        return Ok(Action::await_change());
    }
    // The status this operator last wrote, if the watch has not delivered it yet.
    let d = ctx.memory.newest(cached);
    let image = d.spec.image.clone().unwrap_or_else(|| ctx.settings.worker_image.clone());
    let rev = revision::of(&d.spec, &image);
    // A spec that would mount a node directory the operator may not mount gets no pod at all.
    let host_path_refusal = crate::host_paths::refusal(&d, &ctx.settings.allowed_host_paths);
    let pass = tracing::Span::current();
    pass.record("revision", rev.as_str());
    let (world, reads) = tracing::info_span!("observe", pods = tracing::field::Empty).in_scope(|| {
        let seen = observe::world(ctx, &d, &rev);
        tracing::Span::current().record("pods", seen.0.pods.len() as i64);
        seen
    });
    // The capacity reads that are due run in the background; their answers wake a later pass.
    reads.iter().for_each(|t| ctx.probes.start(t));
    if !world.unread.is_empty() {
        // A restarted operator has not asked these pods yet: deciding now would rewrite status
        // and gates from ignorance. Their first reads wake the next pass.
        return Ok(Action::requeue(Duration::from_secs(2)));
    }

    let now = Time(Timestamp::now());
    let plan = tracing::info_span!("decide")
        .in_scope(|| decide::decide(decide::Inputs { d: &d, revision: &rev, host_path_refusal: host_path_refusal.as_deref(), world: &world, now: &now }));
    if let Some(phase) = plan.status.phase {
        pass.record("phase", <&str>::from(phase));
    }
    if let Some(reason) = plan.rollback {
        // The bake's judgement: the revision is rolled back in this pass.
        pass.record("rollback", <&str>::from(reason));
    }
    let writes = tracing::info_span!("apply", workers = plan.workers.len() as i64, deletes = plan.delete.len() as i64, events = plan.events.len() as i64);
    apply::plan(ctx, &d, &image, &plan).instrument(writes).await?;
    // The background work the plan asks for: the canary of the candidate, the mismatch
    // counters, the serving probes.
    let (owner, uid) = (ObjectRef::from_obj(&d), d.uid().unwrap_or_default());
    let key = || d.spec.engine().integrity().then(|| ctx.root.deployment_key(&uid));
    if let Some(run) = &plan.canary {
        ctx.canaries.start(&owner, &uid, run, key());
    }
    if let Some((targets, pace)) = &plan.scrape {
        ctx.scrapes.want(&owner, &uid, targets.clone(), d.spec.engine().integrity_counters(&d.spec), *pace);
    }
    match &plan.serving_probe {
        Some(run) => ctx.serving_probes.want(&owner, &uid, run, key()),
        None => ctx.serving_probes.stop(&uid),
    }
    // Passes that wait on time come back soon: a bake's clock, a pod whose report is retried, a
    // rollout whose pods exist but are not all verified. Everything else is woken by the watches
    // and the background tasks, and otherwise looked at every 30 s (re-verification), or as
    // often as the serving probes' rounds are due.
    let waiting = plan.status.bake.is_some() || world.pods.iter().any(|p| p.role.holds_kv() && p.report.is_err()) || (!plan.settled && !world.pods.is_empty());
    let idle = plan.serving_probe.as_ref().map_or(30, |p| p.every_seconds.clamp(1, 30));
    Ok(Action::requeue(Duration::from_secs(if waiting { 2 } else { idle })))
}
