//! The deployment's integrity counters, scraped in the background while a promotion or a bake
//! needs them: every `EVERY`, every KV pod's counters of its engine (`engines::integrity`:
//! kvgate's `kvgate_handoff_mismatch_total` by reason; a disaggregated vLLM's NIXL failures and
//! reads after expiry too), kept by pod. A change wakes the reconcile (a bake rolls back within one scrape of a mismatch); a
//! deployment nobody asked about for `IDLE` is no longer scraped. The counters are a part of the
//! deployment's index entry, the loop its `scrape` task.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use kube::runtime::reflector::ObjectRef;

use super::Trigger;
use crate::crd::InferenceDeployment;
use crate::engines::integrity::{self, Counter, Counts};
use crate::index::Index;
use crate::scrape;

/// Every pod's `/metrics` is a few hundred bytes of text: cheap enough to read twice a second
/// while a bake lasts, and a rollback follows a mismatch within about half a second.
pub const EVERY: Duration = Duration::from_millis(500);
/// This task's kind in the index (and the label of `kvgate_operator_background_tasks`).
pub const TASK: &str = "scrape";
const IDLE: Duration = Duration::from_secs(10);

/// A pod's address and the port of its `/metrics`.
pub type Endpoint = (String, u16);

/// The counters of every pod that answered, and whether every pod asked about answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counters {
    pub by_pod: BTreeMap<Endpoint, Counts>,
    pub complete: bool,
}

impl Counters {
    /// Every pod's counts added up, by name.
    pub fn summed(&self) -> Counts {
        let mut out = Counts::new();
        for (name, n) in self.by_pod.values().flatten() {
            *out.entry(name.clone()).or_insert(0) += n;
        }
        out
    }
}

struct Scraped {
    targets: Vec<Endpoint>,
    counters: &'static [Counter],
    latest: Option<BTreeMap<Endpoint, Counts>>,
    wanted: Instant,
}

impl Default for Scraped {
    fn default() -> Self {
        Scraped { targets: Vec::new(), counters: &[], latest: None, wanted: Instant::now() }
    }
}

pub struct Scrapes {
    http: reqwest::Client,
    trigger: Trigger,
    index: Arc<Index>,
}

impl Scrapes {
    pub fn new(http: reqwest::Client, trigger: Trigger, index: Arc<Index>) -> Arc<Self> {
        Arc::new(Scrapes { http, trigger, index })
    }

    /// The latest counters, and whether they cover every one of `targets`.
    pub fn latest(&self, owner_uid: &str, targets: &[Endpoint]) -> Option<Counters> {
        let mut targets = targets.to_vec();
        targets.sort();
        let found = self.index.with(owner_uid, |entry| {
            let by_pod = entry.get::<Scraped>()?.latest.as_ref()?;
            Some(Counters { by_pod: by_pod.clone(), complete: by_pod.keys().eq(targets.iter()) })
        });
        found.flatten()
    }

    /// Keeps `counters` of `targets` (the deployment's KV pods) scraped.
    pub fn want(self: &Arc<Self>, owner: &ObjectRef<InferenceDeployment>, owner_uid: &str, mut targets: Vec<Endpoint>, counters: &'static [Counter]) {
        targets.sort();
        self.index.with(owner_uid, |entry| {
            if !entry.running(TASK, "") {
                entry.spawn(TASK, "", self.clone().run(owner.clone(), owner_uid.to_string()));
            }
            let s = entry.part::<Scraped>();
            (s.targets, s.counters, s.wanted) = (targets, counters, Instant::now());
        });
    }

    async fn run(self: Arc<Self>, owner: ObjectRef<InferenceDeployment>, uid: String) {
        loop {
            let targets = self.index.with(&uid, |entry| match entry.get::<Scraped>() {
                Some(s) if s.wanted.elapsed() < IDLE => Some((s.targets.clone(), s.counters)),
                _ => {
                    entry.drop_part::<Scraped>();
                    None
                }
            });
            let Some(Some((targets, counters))) = targets else { return };
            let reads = join_all(targets.iter().map(|(ip, port)| scrape::metrics(&self.http, ip, *port))).await;
            let by_pod: BTreeMap<Endpoint, Counts> =
                targets.iter().zip(reads).filter_map(|(target, text)| Some((target.clone(), integrity::read(&text.ok()?, counters)))).collect();
            let changed = self.index.with(&uid, |entry| {
                let s = entry.part::<Scraped>();
                let changed = s.latest.as_ref() != Some(&by_pod);
                if !by_pod.is_empty() || targets.is_empty() {
                    s.latest = Some(by_pod);
                }
                changed
            });
            match changed {
                None => return,
                Some(true) => self.trigger.reconcile(&owner),
                Some(false) => {}
            }
            tokio::time::sleep(EVERY).await;
        }
    }
}
