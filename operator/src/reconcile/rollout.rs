//! One reconcile of an InferenceDeployment, as a pipeline: observe (reads only) -> decide (pure:
//! `decide.rs`, where the refuse/promote decision lives) -> apply (writes only).

use std::time::Duration;

use kube::ResourceExt;
use kube::runtime::controller::Action;

use super::{Context, Error, apply, decide, observe};
use crate::crd::InferenceDeployment;
use crate::render::revision;

pub async fn reconcile(cached: &InferenceDeployment, ctx: &Context) -> Result<Action, Error> {
    let ns = cached.namespace().unwrap_or_else(|| "default".into());
    let Some(d) = observe::object(ctx, &ns, &cached.name_any()).await? else {
        return Ok(Action::await_change());
    };
    let image = d.spec.image.clone().unwrap_or_else(|| ctx.worker_image.clone());
    let rev = revision::of(&d.spec, &image);
    // A spec that would mount a node directory the operator may not mount gets no pod at all.
    let host_path_refusal = crate::host_paths::refusal(&d, &ctx.allowed_host_paths);
    let world = observe::world(ctx, &d).await?;

    let plan = decide::decide(decide::Inputs { d: &d, revision: &rev, host_path_refusal: host_path_refusal.as_deref(), world: &world });

    apply::plan(ctx, &d, &image, &plan).await?;
    Ok(Action::requeue(if plan.settled { Duration::from_secs(30) } else { Duration::from_secs(2) }))
}
