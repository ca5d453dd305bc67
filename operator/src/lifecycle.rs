//! The watch of InferenceDeployments feeds the index (`index`): a deployment listed or seen is
//! admitted; deleting one removes its entry, and with it everything the operator held and ran
//! for it (the reports of its pods, its scrapes, canary and serving probes, its retry and apply
//! memory) and its metric series (no alert keeps firing for an object that no longer exists).
//! Everything is keyed by UID, so a namesake created afterwards starts from nothing. Objects in
//! the cluster go with their owner reference (the garbage collector).
//!
//! The watch's delete event is the signal (no finalizer: deleting never waits for the
//! operator). A delete missed while the watch was down is caught when it lists again: whatever is
//! remembered of a UID that is no longer listed is forgotten then.
//!
//! The watch runs from start-up, leading or not (a warm standby: when it takes the Lease, its
//! store and index are current and it reconciles at once); every change wakes the reconcile of
//! its deployment through the `Trigger`, which a standby holds.

use std::collections::HashSet;
use std::sync::Arc;

use futures::StreamExt;
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};

use crate::crd::InferenceDeployment;
use crate::reconcile::Context;
use crate::watch;

/// Starts the watch of `ids`; the store it feeds.
pub fn watch(ids: Api<InferenceDeployment>, ctx: Arc<Context>) -> Store<InferenceDeployment> {
    let (store, writer) = reflector::store();
    let events = watcher(ids, watcher::Config::default()).default_backoff().modify(watch::strip).reflect(writer);
    let reader = store.clone();
    tokio::spawn(async move {
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::Apply(d) | watcher::Event::InitApply(d)) => {
                    seen(&ctx, &d);
                    ctx.trigger.reconcile(&ObjectRef::from_obj(&d));
                }
                Ok(watcher::Event::Delete(d)) => deleted(&ctx, &reader, &d),
                Ok(watcher::Event::InitDone) => sweep(&ctx, &reader),
                Ok(watcher::Event::Init) => {}
                Err(e) => tracing::warn!(kind = %InferenceDeployment::kind(&()), error = %e, "watch failed; it resumes with back-off"),
            }
        }
    });
    store
}

/// Admits `d`, listed or changed.
fn seen(ctx: &Context, d: &InferenceDeployment) {
    if let Some(uid) = d.uid() {
        ctx.index.admit(&uid, &d.namespace().unwrap_or_default(), &d.name_any());
    }
}

/// Forgets the deleted `d`.
fn deleted(ctx: &Context, store: &Store<InferenceDeployment>, d: &InferenceDeployment) {
    let (ns, name, uid) = (d.namespace().unwrap_or_default(), d.name_any(), d.uid().unwrap_or_default());
    tracing::info!(%name, %ns, %uid, "InferenceDeployment deleted: forgetting its state and metric series");
    forget(ctx, store, &uid, &ns, &name);
}

/// After a fresh list: forgets every UID that is no longer there.
fn sweep(ctx: &Context, store: &Store<InferenceDeployment>) {
    let live: HashSet<String> = store.state().iter().filter_map(|d| d.uid()).collect();
    for (uid, ns, name) in ctx.index.known() {
        if !live.contains(&uid) {
            tracing::info!(%name, %ns, %uid, "InferenceDeployment gone while unwatched: forgetting its state");
            forget(ctx, store, &uid, &ns, &name);
        }
    }
}

fn forget(ctx: &Context, store: &Store<InferenceDeployment>, uid: &str, ns: &str, name: &str) {
    // Series are keyed by name: a live namesake (another UID) keeps its own.
    let namesake = store.state().iter().any(|o| o.namespace().as_deref() == Some(ns) && o.name_any() == name && o.uid().as_deref() != Some(uid));
    // Under the index's lock: an export racing this delete runs before it, or finds no entry.
    ctx.index.remove(uid, |_| {
        if !namesake {
            ctx.metrics.forget(ns, name);
        }
    });
}
