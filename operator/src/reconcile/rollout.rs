//! One reconcile of an InferenceDeployment: owned objects, the revision state machine and the
//! rollout gate.
//!
//! Revisions: the serving one (`status.currentRevision`, verified) and the one the spec asks for.
//! When they differ, the spec's revision is the candidate: its own prefill and decode Deployments
//! come up next to the serving ones, which are never touched. Candidate pods carry the readiness
//! gate, so until the operator verifies them they are not Ready and the router's discovery
//! (EndpointSlices) does not see them. Verified and Ready at full strength -> promoted, the old
//! revision's Deployments are deleted. Any pod failing the gate -> the revision is refused:
//! scaled to zero, recorded in status, an Event and a metric; it is not retried until the spec
//! changes (a new revision).

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role as RbacRole, RoleBinding};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};

use super::apply::{apply, delete};
use super::pods::{self, Verification};
use super::status::{self, Observed};
use super::{Context, Error, MANAGER, event, kube_err};
use crate::crd::{InferenceDeployment, RefusedRevision};
use crate::gate::{Role, Verdict};
use crate::render::{labels, revision, router, secret, workers};

pub async fn reconcile(cached: &InferenceDeployment, ctx: &Context) -> Result<Action, Error> {
    let ns = cached.namespace().unwrap_or_else(|| "default".into());
    let name = cached.name_any();
    let client = &ctx.client;
    // The watch cache may lag our own last status write; decisions (refuse once, promote once)
    // are taken on the object as it is now.
    let api: Api<InferenceDeployment> = Api::namespaced(client.clone(), &ns);
    let Some(d) = api.get_opt(&name).await.map_err(kube_err(format!("reading InferenceDeployment {name}")))? else {
        return Ok(Action::await_change());
    };
    let d = &d;
    let image = d.spec.image.clone().unwrap_or_else(|| ctx.worker_image.clone());
    let rev = revision::of(&d.spec, &image);
    let prev = d.status.clone().unwrap_or_default();
    let current = prev.current_revision.clone();
    let refused_before = prev.refused_revision.as_ref().is_some_and(|r| r.revision == rev);
    // A spec that would mount a node directory the operator may not mount gets no pod at all.
    let host_path_refusal = crate::host_paths::refusal(d, &ctx.allowed_host_paths);
    let refused_now = refused_before || host_path_refusal.is_some();

    ensure_secret(d, ctx, &ns).await?;
    for svc in [workers::service(d, Role::Prefill), workers::service(d, Role::Decode), router::api_service(d)] {
        apply::<Service>(client, &ns, &svc).await?;
    }
    apply::<ServiceAccount>(client, &ns, &router::service_account(d)).await?;
    apply::<RbacRole>(client, &ns, &router::role(d)).await?;
    apply::<RoleBinding>(client, &ns, &router::role_binding(d)).await?;

    // The candidate's Deployments: at full size while it is tried, at zero once refused, never
    // when its pods would mount a node directory that is not allowed.
    if host_path_refusal.is_none() {
        for role in [Role::Prefill, Role::Decode] {
            let replicas = if refused_now { 0 } else { d.spec.worker(role).replicas };
            apply::<Deployment>(client, &ns, &workers::deployment(d, role, &rev, &image, replicas)).await?;
        }
    }
    // Deployments of revisions that are neither serving nor the candidate are gone.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let mine = deployments
        .list(&ListParams::default().labels(&format!("{}={name},{}", labels::INSTANCE, labels::REVISION)))
        .await
        .map_err(kube_err("listing Deployments"))?;
    for dep in &mine {
        let r = dep.labels().get(labels::REVISION).cloned().unwrap_or_default();
        if r != rev && Some(&r) != current.as_ref() {
            delete::<Deployment>(client, &ns, &dep.name_any()).await?;
        }
    }

    let pods_api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let candidate = pods::verify(&pods_api, &ctx.http, &name, &rev, d.spec.context_window).await.map_err(kube_err("verifying pods"))?;
    let ready = |revision: &str, role: Role| -> i32 {
        let dep_name = workers::deployment_name(d, role, revision);
        mine.iter().find(|x| x.name_any() == dep_name).and_then(|x| x.status.as_ref()).and_then(|s| s.ready_replicas).unwrap_or(0)
    };

    let mut refused = prev.refused_revision.clone();
    let mut serving = current.clone();
    let mut serving_window = prev.current_context_window;
    let reference = d.object_ref(&());
    if let Some(message) = host_path_refusal.as_ref().filter(|_| !refused_before) {
        let reason = crate::host_paths::REASON;
        refused = Some(RefusedRevision { revision: rev.clone(), reason: reason.into(), message: message.clone() });
        ctx.metrics.refused.with_label_values(&[reason]).inc();
        event(ctx, &reference, EventType::Warning, "RolloutRefused", "HostPathPolicy", format!("revision {rev} refused, no pod created: {message}")).await;
        tracing::warn!(%name, %ns, revision = %rev, %message, "rollout refused");
    }
    if Some(&rev) != current.as_ref() && !refused_now {
        match &candidate.verdict {
            Verdict::Refused { failure, message } => {
                refused = Some(RefusedRevision { revision: rev.clone(), reason: failure.reason().into(), message: message.clone() });
                ctx.metrics.refused.with_label_values(&[failure.reason()]).inc();
                for role in [Role::Prefill, Role::Decode] {
                    apply::<Deployment>(client, &ns, &workers::deployment(d, role, &rev, &image, 0)).await?;
                }
                let keeps = current.as_ref().map_or("no revision serves yet".to_string(), |c| format!("revision {c} keeps serving"));
                event(ctx, &reference, EventType::Warning, "RolloutRefused", "RolloutGate", format!("revision {rev} refused: {message}; {keeps}")).await;
                tracing::warn!(%name, %ns, revision = %rev, %message, "rollout refused");
            }
            Verdict::Verified if full_strength(d, &candidate, |r| ready(&rev, r)) => {
                event(
                    ctx,
                    &reference,
                    EventType::Normal,
                    "RolloutVerified",
                    "RolloutGate",
                    format!("revision {rev}: every pod's KV pool holds contextWindow {}; now serving", d.spec.context_window),
                )
                .await;
                if let Some(old) = &current {
                    for role in [Role::Prefill, Role::Decode] {
                        delete::<Deployment>(client, &ns, &workers::deployment_name(d, role, old)).await?;
                    }
                }
                serving = Some(rev.clone());
                serving_window = Some(d.spec.context_window);
                refused = refused.filter(|r| r.revision != rev);
            }
            _ => {}
        }
    }

    // The router admits what the serving revision was verified for (and, like the workers, is
    // not rendered from a spec whose host path is refused).
    let window = serving_window.unwrap_or(d.spec.context_window);
    let router_dep = match host_path_refusal {
        None => Some(apply::<Deployment>(client, &ns, &router::deployment(d, &image, window)).await?),
        Some(_) => deployments.get_opt(&router::router_name(d)).await.map_err(kube_err("reading the router Deployment"))?,
    };

    // Status describes the serving revision, or before there is one, the candidate.
    let shown = serving.clone().unwrap_or_else(|| rev.clone());
    let shown_pods =
        if shown == rev { candidate.clone() } else { pods::verify(&pods_api, &ctx.http, &name, &shown, window).await.map_err(kube_err("verifying pods"))? };
    let observed = Observed {
        spec_revision: rev.clone(),
        serving: serving.clone(),
        serving_window,
        refused: refused.clone(),
        candidate: candidate.clone(),
        shown_pods,
        ready: [Role::Prefill, Role::Decode].map(|r| ready(&shown, r)),
        router_ready: router_dep.and_then(|r| r.status).and_then(|s| s.ready_replicas).unwrap_or(0),
    };
    let next = status::compute(d, &prev, &observed);
    export(ctx, &ns, &name, d, &next);
    if next != prev {
        let body = serde_json::json!({ "apiVersion": InferenceDeployment::api_version(&()), "kind": InferenceDeployment::kind(&()), "status": next });
        api.patch_status(&name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(&body)).await.map_err(kube_err("writing status"))?;
    }
    let settled = serving.as_ref() == Some(&rev) || refused.as_ref().is_some_and(|r| r.revision == rev);
    Ok(Action::requeue(if settled { Duration::from_secs(30) } else { Duration::from_secs(2) }))
}

/// The per-deployment gauges: the window, the serving revision's smallest measured pools, and
/// whether the spec's revision stands refused.
fn export(ctx: &Context, ns: &str, name: &str, d: &InferenceDeployment, status: &crate::crd::InferenceDeploymentStatus) {
    let m = &ctx.metrics;
    m.context_window.with_label_values(&[ns, name]).set(d.spec.context_window as i64);
    for (role, rs) in [("prefill", &status.prefill), ("decode", &status.decode)] {
        let serving = rs.as_ref().filter(|r| r.revision.is_some() && r.revision == status.current_revision);
        match serving.and_then(|r| r.min_measured_tokens) {
            Some(tokens) => m.pool_tokens.with_label_values(&[ns, name, role]).set(tokens as i64),
            None => {
                let _ = m.pool_tokens.remove_label_values(&[ns, name, role]);
            }
        }
    }
    let refused = status.refused_revision.as_ref().filter(|_| crate::conditions::is_true(&status.conditions, crate::conditions::ROLLOUT_REFUSED));
    for reason in crate::metrics::REFUSAL_REASONS {
        let _ = m.refused_now.remove_label_values(&[ns, name, reason]);
    }
    if let Some(r) = refused {
        m.refused_now.with_label_values(&[ns, name, &r.reason]).set(1);
    }
}

/// Every desired pod of both roles exists, passed the gate and is Ready.
fn full_strength(d: &InferenceDeployment, v: &Verification, ready: impl Fn(Role) -> i32) -> bool {
    [Role::Prefill, Role::Decode].into_iter().all(|r| {
        let want = d.spec.worker(r).replicas;
        want > 0 && v.pods.get(&r).copied().unwrap_or(0) == want && v.verified.get(&r).copied().unwrap_or(0) == want && ready(r) >= want
    })
}

/// Creates the generated handoff Secret once; never rewrites it.
async fn ensure_secret(d: &InferenceDeployment, ctx: &Context, ns: &str) -> Result<(), Error> {
    if d.spec.handoff.secret_name.is_some() {
        return Ok(());
    }
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let name = secret::secret_name(d);
    if api.get_metadata_opt(&name).await.map_err(kube_err(format!("reading Secret {name}")))?.is_none() {
        match api.create(&PostParams { field_manager: Some(MANAGER.into()), ..Default::default() }, &secret::generated(d)).await {
            Ok(_) => tracing::info!(secret = name, namespace = ns, "generated the handoff secret"),
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(kube_err(format!("creating Secret {name}"))(e)),
        }
    }
    Ok(())
}
