//! Apply: writes what `decide` planned. Server-side apply of owned objects (applying what is
//! already there writes nothing), deletion of those no longer wanted, pod gate conditions,
//! Events, metrics and status.

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role as RbacRole, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

use super::decide::Plan;
use super::{Context, Error, MANAGER, event};
use crate::crd::{InferenceDeployment, InferenceDeploymentStatus};
use crate::gate::Role;
use crate::render::{router, secret, workers};

/// Applies `obj` (named by its metadata) in `ns`; unchanged objects are not written.
pub async fn apply<K>(client: &kube::Client, ns: &str, obj: &K) -> Result<K, Error>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + Serialize + DeserializeOwned + Clone + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    let name = obj.meta().name.clone().unwrap_or_default();
    let mut body = serde_json::to_value(obj).expect("k8s objects serialize");
    body["apiVersion"] = K::api_version(&()).into();
    body["kind"] = K::kind(&()).into();
    api.patch(&name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(&body)).await.map_err(Error::api(format!("applying {} {name}", K::kind(&()))))
}

pub async fn delete<K>(client: &kube::Client, ns: &str, name: &str) -> Result<(), Error>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + DeserializeOwned + Clone + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(Error::api(format!("deleting {} {name}", K::kind(&())))(e)),
    }
}

/// Writes a plan: the objects every deployment owns, the revision's Deployments, deletions, the
/// router, pod gate conditions, Events, metrics and, when it changed, status.
pub async fn plan(ctx: &Context, d: &InferenceDeployment, image: &str, plan: &Plan) -> Result<(), Error> {
    let client = &ctx.client;
    let ns = d.namespace().unwrap_or_else(|| "default".into());
    let name = d.name_any();
    ensure_secret(ctx, d, &ns).await?;
    for svc in [workers::service(d, Role::Prefill), workers::service(d, Role::Decode), router::api_service(d)] {
        apply::<Service>(client, &ns, &svc).await?;
    }
    apply::<ServiceAccount>(client, &ns, &router::service_account(d)).await?;
    apply::<RbacRole>(client, &ns, &router::role(d)).await?;
    apply::<RoleBinding>(client, &ns, &router::role_binding(d)).await?;
    for w in &plan.workers {
        apply::<Deployment>(client, &ns, &workers::deployment(d, w.role, &w.revision, image, w.replicas, ctx.worker_log_format)).await?;
    }
    for dep in &plan.delete {
        delete::<Deployment>(client, &ns, dep).await?;
    }
    if let Some(window) = plan.router_window {
        apply::<Deployment>(client, &ns, &router::deployment(d, plan.router_image.as_deref().unwrap_or(image), window, ctx.worker_log_format)).await?;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    for gate in &plan.pod_gates {
        let since = gate.since.clone().unwrap_or_else(|| Time(Timestamp::now()));
        let patch = json!({ "status": { "conditions": [{
            "type": crate::gate::CONDITION, "status": gate.status, "reason": gate.reason, "message": gate.message, "lastTransitionTime": since,
        }]}});
        // Strategic merge keys conditions by type: the kubelet's own conditions are left alone.
        match pods.patch_status(&gate.pod, &PatchParams::default(), &Patch::Strategic(patch)).await {
            Ok(_) => {}
            // Gone since it was observed: the next reconcile sees its replacement.
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(Error::api(format!("setting the gate condition of pod {}", gate.pod))(e)),
        }
    }
    let reference = d.object_ref(&());
    if let Some(reason) = &plan.refused_reason {
        ctx.metrics.refused.with_label_values(&[reason]).inc();
        tracing::warn!(%name, %ns, reason, "rollout refused");
    }
    if let Some(reason) = plan.rollback {
        ctx.metrics.rollbacks.with_label_values(&[reason]).inc();
        tracing::warn!(%name, %ns, reason, "rolled back");
    }
    for e in &plan.events {
        let kind = if e.warning { EventType::Warning } else { EventType::Normal };
        event(ctx, &reference, kind, e.reason, e.action, e.note.clone()).await;
    }
    ctx.metrics.export(&ns, &name, d.spec.context_window, &plan.status, plan.unverified.len());
    if Some(&plan.status) != d.status.as_ref() {
        status(ctx, d, &plan.status).await?;
    }
    Ok(())
}

/// Writes the whole status (server-side apply: fields left out would be dropped).
pub async fn status(ctx: &Context, d: &InferenceDeployment, status: &InferenceDeploymentStatus) -> Result<(), Error> {
    let api: Api<InferenceDeployment> = Api::namespaced(ctx.client.clone(), &d.namespace().unwrap_or_else(|| "default".into()));
    let body = json!({ "apiVersion": InferenceDeployment::api_version(&()), "kind": InferenceDeployment::kind(&()), "status": status });
    api.patch_status(&d.name_any(), &PatchParams::apply(MANAGER).force(), &Patch::Apply(&body)).await.map_err(Error::api("writing status"))?;
    Ok(())
}

/// Creates the generated handoff Secret once; never rewrites it. An existing Secret is
/// recognised by the create's 409, once per operator process.
async fn ensure_secret(ctx: &Context, d: &InferenceDeployment, ns: &str) -> Result<(), Error> {
    if d.spec.handoff.secret_name.is_some() {
        return Ok(());
    }
    let name = secret::secret_name(d);
    let key = format!("{ns}/{name}");
    if ctx.secrets_created.lock().unwrap().contains(&key) {
        return Ok(());
    }
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    match api.create(&PostParams { field_manager: Some(MANAGER.into()), ..Default::default() }, &secret::generated(d)).await {
        Ok(_) => tracing::info!(secret = name, namespace = ns, "generated the handoff secret"),
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(Error::api(format!("creating Secret {name}"))(e)),
    }
    ctx.secrets_created.lock().unwrap().insert(key);
    Ok(())
}
