//! One entry per InferenceDeployment, keyed by UID and fed by its watch. Everything the operator
//! knows and runs for a deployment hangs off its entry: what its reconciles remember
//! (`reconcile::memory`), the state of each background task (`tasks::*`, one typed part each)
//! and the handles of those tasks. The watch admits an entry when it lists or sees the
//! deployment; its delete removes the entry, which aborts every task of it and runs, under the
//! same lock, whatever must go with it (the metric series).
//!
//! Nothing else creates an entry. A reconcile still running when the delete arrives, a task
//! finishing after it, or a metric export racing it, finds no entry and does nothing: a UID that
//! is gone can never be put back.
//!
//! Each task keeps its state as a part typed by itself, so the index knows no task and a new
//! task touches no other module.

use std::any::{Any, TypeId};
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Mutex;

use tokio::task::AbortHandle;

/// The kinds of background task a deployment runs; each is the `kind` label of
/// `kvgate_operator_background_tasks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, strum::IntoStaticStr, strum::VariantArray)]
#[strum(serialize_all = "kebab-case")]
pub enum TaskKind {
    /// Reading one pod's capacity report (`tasks::probes`).
    Probe,
    /// Scraping the KV pods' integrity counters (`tasks::scrapes`).
    Scrape,
    /// The integrity canary of a revision (`tasks::canaries`).
    Canary,
    /// The probes of the serving revision's pods (`tasks::serving_probes`).
    ServingProbe,
}

impl TaskKind {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// What the operator holds for one deployment.
pub struct Entry {
    pub namespace: String,
    pub name: String,
    parts: HashMap<TypeId, Box<dyn Any + Send>>,
    /// Background tasks by (kind, key): at most one of each, a new one replaces the one before.
    tasks: HashMap<(TaskKind, String), AbortHandle>,
}

impl Entry {
    fn new(namespace: &str, name: &str) -> Entry {
        Entry { namespace: namespace.into(), name: name.into(), parts: HashMap::new(), tasks: HashMap::new() }
    }

    /// The part of type `T`, created empty when there is none.
    pub fn part<T: Default + Send + 'static>(&mut self) -> &mut T {
        self.parts.entry(TypeId::of::<T>()).or_insert_with(|| Box::new(T::default())).downcast_mut().expect("parts are keyed by their type")
    }

    /// The part of type `T`, if there is one.
    pub fn get<T: Send + 'static>(&mut self) -> Option<&mut T> {
        self.parts.get_mut(&TypeId::of::<T>()).and_then(|p| p.downcast_mut())
    }

    pub fn drop_part<T: 'static>(&mut self) {
        self.parts.remove(&TypeId::of::<T>());
    }

    /// Runs `task` as this deployment's `kind` task for `key`, aborting the one it replaces.
    pub fn spawn(&mut self, kind: TaskKind, key: &str, task: impl Future<Output = ()> + Send + 'static) {
        self.tasks.retain(|_, t| !t.is_finished());
        if let Some(before) = self.tasks.insert((kind, key.to_string()), tokio::spawn(task).abort_handle()) {
            before.abort();
        }
    }

    /// Aborts the `kind` task for `key`, if one runs.
    pub fn stop(&mut self, kind: TaskKind, key: &str) {
        if let Some(t) = self.tasks.remove(&(kind, key.to_string())) {
            t.abort();
        }
    }

    /// Whether the `kind` task for `key` is still running.
    pub fn running(&self, kind: TaskKind, key: &str) -> bool {
        self.tasks.get(&(kind, key.to_string())).is_some_and(|t| !t.is_finished())
    }
}

impl Drop for Entry {
    /// An entry's tasks never outlive it.
    fn drop(&mut self) {
        self.tasks.values().for_each(AbortHandle::abort);
    }
}

#[derive(Default)]
pub struct Index {
    entries: Mutex<HashMap<String, Entry>>,
}

impl Index {
    /// A deployment the watch listed or saw change: known from now on (its name kept current).
    pub fn admit(&self, uid: &str, namespace: &str, name: &str) {
        let mut entries = self.entries.lock().unwrap();
        let e = entries.entry(uid.to_string()).or_insert_with(|| Entry::new(namespace, name));
        if e.name != name || e.namespace != namespace {
            (e.namespace, e.name) = (namespace.into(), name.into());
        }
    }

    /// Removes `uid` (deleted): its tasks are aborted and `also` runs before anyone can look at
    /// the index again. Whether it was known.
    pub fn remove(&self, uid: &str, also: impl FnOnce(&Entry)) -> bool {
        let mut entries = self.entries.lock().unwrap();
        let Some(e) = entries.remove(uid) else { return false };
        also(&e);
        drop(e);
        true
    }

    /// `f` on the entry of `uid`, under the index's lock; `None` when the deployment is gone (or
    /// not yet seen by the watch).
    pub fn with<R>(&self, uid: &str, f: impl FnOnce(&mut Entry) -> R) -> Option<R> {
        self.entries.lock().unwrap().get_mut(uid).map(f)
    }

    /// `f` on every entry (a pod deleted: whichever entry read it forgets it).
    pub fn each(&self, mut f: impl FnMut(&mut Entry)) {
        self.entries.lock().unwrap().values_mut().for_each(&mut f);
    }

    /// Every known UID with its namespace and name.
    pub fn known(&self) -> Vec<(String, String, String)> {
        self.entries.lock().unwrap().iter().map(|(uid, e)| (uid.clone(), e.namespace.clone(), e.name.clone())).collect()
    }

    /// Whether `uid` is known (admitted and not removed).
    pub fn contains(&self, uid: &str) -> bool {
        self.entries.lock().unwrap().contains_key(uid)
    }

    pub fn len(&self) -> usize {
        self.entries.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Running background tasks by kind, over every deployment.
    pub fn running_tasks(&self) -> BTreeMap<TaskKind, usize> {
        let mut by_kind = BTreeMap::new();
        for e in self.entries.lock().unwrap().values() {
            for ((kind, _), t) in &e.tasks {
                if !t.is_finished() {
                    *by_kind.entry(*kind).or_insert(0) += 1;
                }
            }
        }
        by_kind
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use super::*;

    #[derive(Default)]
    struct Counter(u32);

    /// A task that runs until aborted, and says whether it was.
    fn endless(dropped: Arc<AtomicBool>) -> impl Future<Output = ()> + Send + 'static {
        struct Guard(Arc<AtomicBool>);
        impl Drop for Guard {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let guard = Guard(dropped);
        async move {
            let _guard = guard;
            std::future::pending::<()>().await
        }
    }

    #[tokio::test]
    async fn a_removed_entry_stops_its_tasks_and_nothing_can_put_it_back() {
        let index = Index::default();
        index.admit("u", "ns", "llm");
        let (first, second, replaced) = (Arc::default(), Arc::<AtomicBool>::default(), Arc::<AtomicBool>::default());
        index.with("u", |e| {
            e.part::<Counter>().0 += 1;
            e.spawn(TaskKind::Scrape, "", endless(replaced.clone()));
            e.spawn(TaskKind::Scrape, "", endless(Arc::clone(&first)));
            e.spawn(TaskKind::Probe, "pod-1", endless(Arc::clone(&second)));
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(replaced.load(Ordering::SeqCst), "a task of the same kind and key replaces the one before");
        assert_eq!(index.running_tasks(), BTreeMap::from([(TaskKind::Probe, 1), (TaskKind::Scrape, 1)]));

        let mut also = None;
        assert!(index.remove("u", |e| also = Some(e.name.clone())));
        assert_eq!(also.as_deref(), Some("llm"), "what goes with the entry runs under its lock");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(first.load(Ordering::SeqCst) && second.load(Ordering::SeqCst), "every task of the entry aborted");

        // Late: a reconcile or task of the deleted UID writes nothing and starts nothing.
        assert_eq!(index.with("u", |e| e.part::<Counter>().0), None);
        assert!(index.is_empty() && index.running_tasks().is_empty());
        assert!(!index.remove("u", |_| panic!("nothing to remove")));

        // Seen again (a namesake has another UID; this is the watch re-listing one it knows).
        index.admit("u", "ns", "llm");
        assert_eq!(index.with("u", |e| e.part::<Counter>().0), Some(0), "starts from nothing");
    }
}
