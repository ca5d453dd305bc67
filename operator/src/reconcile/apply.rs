//! Apply: writes what `decide` planned, as `build` turned it into objects, and only what differs
//! from what the watches show. Server-side apply of owned objects (skipped when the watched
//! object already holds every field), deletion of those no longer wanted, pod gate conditions
//! that changed, status when it changed, then Events and metrics. It knows no engine.

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

use super::build::{self, Desired, Write};
use super::context::{Context, Error, event};
use super::decide::Plan;
use super::inference_pool;
use crate::crd::{InferenceDeployment, InferenceDeploymentStatus};
use crate::labels::MANAGER;
use crate::render::secret;
use crate::watch::{self, owned};

/// Applies `obj` unless the watched copy in `store` already holds it. Unchanged objects are
/// never written, and not even sent once the watch shows the version an apply returned.
async fn apply<K>(ctx: &Context, d: &InferenceDeployment, store: &Store<K>, obj: &K) -> Result<(), Error>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + Serialize + DeserializeOwned + Clone + std::fmt::Debug,
{
    let ns = d.namespace().unwrap_or_default();
    let name = obj.meta().name.clone().unwrap_or_default();
    let mut body = serde_json::to_value(obj).expect("k8s objects serialize");
    body["apiVersion"] = K::api_version(&()).into();
    body["kind"] = K::kind(&()).into();
    let key = format!("{}/{name}", K::kind(&()));
    // One digest serves both checks: the version this process's last apply returned, and the
    // fields the watch saw the operator own.
    let digest = owned::desired(&body);
    if let Some(seen) = watch::get(store, &ns, &name) {
        let version = seen.resource_version();
        if ctx.memory.applied(d, &key, digest, version.as_deref()) || ctx.stores.digests.holds(&*seen, digest) {
            return Ok(());
        }
    }
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &ns);
    let written = api.patch(&name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(&body)).await.map_err(Error::api(format!("applying {key}")))?;
    ctx.memory.set_applied(d, key, digest, written.resource_version());
    Ok(())
}

async fn delete<K>(client: &kube::Client, ns: &str, name: &str) -> Result<(), Error>
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

/// Writes a plan: the objects `build` makes of it, in order, pod gate conditions, Events,
/// metrics and, when it changed, status.
pub async fn plan(ctx: &Context, d: &InferenceDeployment, image: &str, plan: &Plan) -> Result<(), Error> {
    let stores = &ctx.stores;
    let ns = d.namespace().unwrap_or_else(|| "default".into());
    let name = d.name_any();
    let service_exists = |n: &str| stores.services.state().iter().any(|s| s.namespace().as_deref() == Some(&ns) && s.name_any() == n);
    let objects = build::objects(d, image, plan, &ctx.settings.worker_telemetry, service_exists);
    if objects.handoff_secret {
        ensure_secret(ctx, d, &ns, plan.recreate_secret).await?;
    }
    for write in &objects.writes {
        match write {
            Write::Apply(Desired::ConfigMap(o)) => apply(ctx, d, &stores.config_maps, o).await?,
            Write::Apply(Desired::Service(o)) => apply(ctx, d, &stores.services, o).await?,
            Write::Apply(Desired::ServiceAccount(o)) => apply(ctx, d, &stores.service_accounts, o).await?,
            Write::Apply(Desired::Role(o)) => apply(ctx, d, &stores.roles, o).await?,
            Write::Apply(Desired::RoleBinding(o)) => apply(ctx, d, &stores.role_bindings, o).await?,
            Write::Apply(Desired::Deployment(o)) => apply(ctx, d, &stores.deployments, o).await?,
            Write::DeleteDeployment(n) => delete::<Deployment>(&ctx.client, &ns, n).await?,
            Write::DeleteService(n) => delete::<k8s_openapi::api::core::v1::Service>(&ctx.client, &ns, n).await?,
        }
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    for gate in &plan.pod_gates {
        let since = &gate.since;
        let patch = json!({ "status": { "conditions": [{
            "type": crate::gate::CONDITION, "status": gate.status(), "reason": gate.reason.as_str(), "message": gate.message, "lastTransitionTime": since,
        }]}});
        // Strategic merge keys conditions by type: the kubelet's own conditions are left alone.
        match pods.patch_status(&gate.pod, &PatchParams::default(), &Patch::Strategic(patch)).await {
            Ok(_) => {}
            // Gone since it was observed: the next reconcile sees its replacement.
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(Error::api(format!("setting the gate condition of pod {}", gate.pod))(e)),
        }
    }
    // Status first: it is the record the next pass (of this or another operator) decides on.
    // A pass killed after it announces nothing twice; one killed before it decides again.
    if Some(&plan.status) != d.status.as_ref() {
        status(ctx, d, &plan.status).await?;
    }
    // The gateway's pool: what this sync finds is the next pass's condition; a pass is woken
    // only when it says something the status just written does not.
    let written = plan.status.conditions.iter().find(|c| c.type_ == inference_pool::CONDITION);
    let found = inference_pool::condition(d, &inference_pool::sync(ctx, d, &ns, written.is_some()).await);
    let news = inference_pool::differs(found.as_ref(), written);
    ctx.memory.pool_synced(d, found);
    if news {
        ctx.trigger.reconcile(&ObjectRef::from_obj(d));
    }
    let reference = d.object_ref(&());
    if let Some(reason) = plan.refused_reason {
        ctx.metrics.refused.with_label_values(&[reason.as_str()]).inc();
        tracing::warn!(%name, %ns, %reason, "rollout refused");
    }
    if let Some(reason) = plan.rollback {
        ctx.metrics.rollbacks.with_label_values(&[reason.as_str()]).inc();
        tracing::warn!(%name, %ns, %reason, "rolled back");
    }
    for e in &plan.events {
        let kind = if e.warning { EventType::Warning } else { EventType::Normal };
        event(ctx, &reference, kind, e.reason, e.action, e.note.clone()).await;
    }
    // Under the index's lock: a deployment deleted meanwhile gets no series back.
    ctx.index.with(&d.uid().unwrap_or_default(), |_| ctx.metrics.export(&ns, &name, d.spec.context_window, &plan.status, plan.unverified.len()));
    Ok(())
}

/// Writes the whole status (server-side apply: fields left out would be dropped).
async fn status(ctx: &Context, d: &InferenceDeployment, status: &InferenceDeploymentStatus) -> Result<(), Error> {
    let api: Api<InferenceDeployment> = Api::namespaced(ctx.client.clone(), &d.namespace().unwrap_or_else(|| "default".into()));
    let body = json!({ "apiVersion": InferenceDeployment::api_version(&()), "kind": InferenceDeployment::kind(&()), "status": status });
    let written = api.patch_status(&d.name_any(), &PatchParams::apply(MANAGER).force(), &Patch::Apply(&body)).await.map_err(Error::api("writing status"))?;
    ctx.memory.wrote_status(d, written.resource_version(), status);
    Ok(())
}

/// Creates the deployment's handoff Secret (its name carries the UID; its bytes derive from the
/// root key) unless the status this operator wrote names it. The operator cannot read Secrets:
/// "it exists" is learnt from its own create (or the create's 409), recorded in
/// `status.handoffSecret` by the same pass, and doubted again when a pod reports it `missing`.
async fn ensure_secret(ctx: &Context, d: &InferenceDeployment, ns: &str, missing: bool) -> Result<(), Error> {
    let name = secret::secret_name(d);
    if !missing && d.status.as_ref().and_then(|s| s.handoff_secret.as_deref()) == Some(name.as_str()) {
        return Ok(());
    }
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    match api.create(&PostParams { field_manager: Some(MANAGER.into()), ..Default::default() }, &secret::generated(d, &ctx.root)).await {
        Ok(_) => tracing::info!(secret = name, namespace = ns, "created the handoff secret"),
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(Error::api(format!("creating Secret {name}"))(e)),
    }
    Ok(())
}
