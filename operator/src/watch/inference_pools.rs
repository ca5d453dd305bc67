//! The optional InferencePools (Gateway API Inference Extension), watched once a deployment asks
//! for one. Their CRD is not the operator's: it may be missing, installed later or removed, so
//! this watch is not one of the stores a reconcile waits for. It starts with the first pass that
//! syncs a pool (a cluster where nobody asks for one is never asked about them), retries with
//! back-off while the type is not served, and its store counts only between a complete list and
//! the next error: until then a pass reads its pool with one GET (`reconcile::inference_pool`).
//! A change to a pool wakes its deployment, so a pool edited by hand is put back at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};

use crate::labels;
use crate::render::inference_pool::api_resource;
use crate::tasks::Trigger;

/// The pools' watch, started on first use.
pub struct Pools {
    client: kube::Client,
    namespace: Option<String>,
    trigger: Trigger,
    started: OnceLock<Watched>,
}

struct Watched {
    store: Store<DynamicObject>,
    /// Whether the store holds a complete list (set on each list's end, cleared on any error).
    listed: Arc<AtomicBool>,
}

/// What the watch knows of one pool.
#[derive(Debug)]
pub enum Seen {
    /// Listed: the pool as last seen, or `None` when there is none.
    Known(Option<Arc<DynamicObject>>),
    /// The watch has not listed (the type is not served, or it is between an error and its
    /// next list): read it from the API server.
    Unknown,
}

impl Pools {
    pub fn new(client: &kube::Client, namespace: Option<&str>, trigger: &Trigger) -> Pools {
        Pools { client: client.clone(), namespace: namespace.map(String::from), trigger: trigger.clone(), started: OnceLock::new() }
    }

    /// The pool `name` in `ns`, starting the watch if this is the first ask.
    pub fn get(&self, ns: &str, name: &str) -> Seen {
        let w = self.started.get_or_init(|| self.start());
        if !w.listed.load(Ordering::Acquire) {
            return Seen::Unknown;
        }
        Seen::Known(w.store.get(&ObjectRef::new_with(name, api_resource()).within(ns)))
    }

    fn start(&self) -> Watched {
        let resource = api_resource();
        let api: Api<DynamicObject> = match &self.namespace {
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, &resource),
            None => Api::all_with(self.client.clone(), &resource),
        };
        let writer = reflector::store::Writer::new(resource.clone());
        let store = writer.as_reader();
        let listed = Arc::new(AtomicBool::new(false));
        let config = watcher::Config::default().labels(&format!("{}={}", labels::MANAGED_BY, labels::OPERATOR));
        let events = watcher(api, config).default_backoff().modify(super::strip).reflect(writer);
        let (flag, trigger) = (listed.clone(), self.trigger.clone());
        tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            while let Some(event) = events.next().await {
                match event {
                    Ok(watcher::Event::InitDone) => flag.store(true, Ordering::Release),
                    Ok(watcher::Event::Apply(o) | watcher::Event::Delete(o)) => super::controller_of(&o).iter().for_each(|r| trigger.reconcile(r)),
                    Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
                    Err(e) => {
                        flag.store(false, Ordering::Release);
                        log(&e, &resource);
                    }
                }
            }
        });
        Watched { store, listed }
    }
}

/// A type that is not served is the expected state of a cluster without the extension (the
/// pass's condition says so); anything else is worth a warning.
fn log(e: &watcher::Error, resource: &ApiResource) {
    let not_served = match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s)) | watcher::Error::WatchStartFailed(kube::Error::Api(s)) => s.code == 404,
        watcher::Error::WatchError(s) => s.code == 404,
        _ => false,
    };
    if not_served {
        tracing::debug!(kind = %resource.kind, "not served; the watch retries with back-off and passes read their pool meanwhile");
    } else {
        tracing::warn!(kind = %resource.kind, error = %e, "watch failed; passes read their pool until it lists again");
    }
}
