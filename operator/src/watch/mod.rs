//! Watch-fed state: everything the operator reads about the objects it owns comes from reflector
//! stores fed by one watch per kind (label-selected to what it manages), never from a GET or a
//! LIST per reconcile. Each change wakes the reconcile of the InferenceDeployment it belongs to;
//! a deleted pod's cached report is dropped. The operator waits for every store's first list
//! before it reconciles anything, so a pass never mistakes "not listed yet" for "missing".
//! The stores keep each object as `cached` trims it, not whole; `digests` keeps, beside them,
//! the digest of what the operator owns of each.

pub mod cached;
pub mod diff;
pub mod digests;
pub mod inference_pools;
pub mod owned;

use std::fmt::Debug;
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;

use crate::crd::InferenceDeployment;
use crate::labels;
use crate::tasks::Trigger;
use cached::Cached;
use digests::Digests;
use inference_pools::Pools;

/// Every kind the operator owns, as the watches last saw it.
#[derive(Clone)]
pub struct Stores {
    pub deployments: Store<Deployment>,
    pub pods: Store<Pod>,
    pub services: Store<Service>,
    pub service_accounts: Store<ServiceAccount>,
    pub roles: Store<Role>,
    pub role_bindings: Store<RoleBinding>,
    /// kvgate's vLLM connector package, one per deployment that verifies handoffs inside vLLM.
    pub config_maps: Store<ConfigMap>,
    /// Of every kind above that the operator applies, what it owns of each object, digested.
    pub digests: Arc<Digests>,
    /// The optional InferencePools: watched from the first pass that syncs one, not waited for.
    pub inference_pools: Arc<Pools>,
}

impl Stores {
    /// Starts the watches (every namespace, or `namespace`); `pod_gone` hears of deleted pods.
    pub fn start(client: &kube::Client, namespace: Option<&str>, trigger: &Trigger, pod_gone: impl Fn(&Pod) + Send + Sync + 'static) -> Stores {
        let managed = format!("{}={}", labels::MANAGED_BY, labels::OPERATOR);
        let digests = Arc::new(Digests::default());
        let d = &digests;
        Stores {
            deployments: watch(api_for(client, namespace), &managed, d, trigger, controller_of, |_| {}),
            pods: watch(api_for(client, namespace), &managed, d, trigger, instance_of, pod_gone),
            services: watch(api_for(client, namespace), &managed, d, trigger, controller_of, |_| {}),
            service_accounts: watch(api_for(client, namespace), &managed, d, trigger, controller_of, |_| {}),
            roles: watch(api_for(client, namespace), &managed, d, trigger, controller_of, |_| {}),
            role_bindings: watch(api_for(client, namespace), &managed, d, trigger, controller_of, |_| {}),
            config_maps: watch(api_for(client, namespace), &managed, d, trigger, controller_of, |_| {}),
            digests,
            inference_pools: Arc::new(Pools::new(client, namespace, trigger)),
        }
    }

    /// Once every watch has listed what exists.
    pub async fn ready(&self) -> anyhow::Result<()> {
        let (a, b, c, d, e, f, g) = futures::join!(
            self.deployments.wait_until_ready(),
            self.pods.wait_until_ready(),
            self.services.wait_until_ready(),
            self.service_accounts.wait_until_ready(),
            self.roles.wait_until_ready(),
            self.role_bindings.wait_until_ready(),
            self.config_maps.wait_until_ready(),
        );
        a.and(b).and(c).and(d).and(e).and(f).and(g).map_err(|e| anyhow::anyhow!("a watch stopped before its first list: {e}"))
    }
}

fn api_for<K>(client: &kube::Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// A store of `K` objects matching `labels`, fed by a watch this spawns (each object's digest
/// recorded in `digests`, then trimmed). Every change wakes the reconcile of its `owner`; `gone`
/// hears of deletions.
fn watch<K>(
    api: Api<K>,
    labels: &str,
    digests: &Arc<Digests>,
    trigger: &Trigger,
    owner: fn(&K) -> Option<ObjectRef<InferenceDeployment>>,
    gone: impl Fn(&K) + Send + Sync + 'static,
) -> Store<K>
where
    K: Cached<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (reader, writer) = reflector::store();
    let trigger = trigger.clone();
    let digests = digests.clone();
    let events = watcher(api, watcher::Config::default().labels(labels))
        .default_backoff()
        .map_ok(move |mut event| {
            digests.observe(&mut event);
            event
        })
        .reflect(writer);
    tokio::spawn(async move {
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => owner(&o).iter().for_each(|r| trigger.reconcile(r)),
                Ok(watcher::Event::Delete(o)) => {
                    gone(&o);
                    owner(&o).iter().for_each(|r| trigger.reconcile(r));
                }
                Ok(watcher::Event::Init | watcher::Event::InitDone) => {}
                Err(e) => tracing::warn!(kind = %K::kind(&()), error = %e, "watch failed; it resumes with back-off"),
            }
        }
    });
    reader
}

/// What the operator never reads of an InferenceDeployment or an InferencePool: managed fields.
pub fn strip<K: Resource>(o: &mut K) {
    o.meta_mut().managed_fields = None;
}

/// The InferenceDeployment an object is controlled by (its owner reference).
pub fn controller_of<K: Resource>(o: &K) -> Option<ObjectRef<InferenceDeployment>> {
    let owner = o.meta().owner_references.as_ref()?.iter().find(|r| r.controller == Some(true) && r.kind == "InferenceDeployment")?;
    Some(ObjectRef::new(&owner.name).within(o.meta().namespace.as_deref()?))
}

/// The InferenceDeployment a pod belongs to (its instance label; pods are owned by ReplicaSets).
pub fn instance_of(pod: &Pod) -> Option<ObjectRef<InferenceDeployment>> {
    Some(ObjectRef::new(pod.labels().get(labels::INSTANCE)?).within(pod.namespace().as_deref()?))
}

/// The object `name` in `ns` as the store last saw it.
pub fn get<K>(store: &Store<K>, ns: &str, name: &str) -> Option<Arc<K>>
where
    K: Resource<DynamicType = ()> + Clone,
{
    store.get(&ObjectRef::new(name).within(ns))
}
