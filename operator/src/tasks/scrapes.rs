//! The deployment's handoff mismatch counters, scraped in the background while a promotion or a
//! bake needs them: every `EVERY`, every worker pod's `kvgate_handoff_mismatch_total` summed by
//! reason. A change wakes the reconcile (a bake rolls back within one scrape of a mismatch); a
//! deployment nobody asked about for `IDLE` is no longer scraped. The counters are a part of the
//! deployment's index entry, the loop its `scrape` task.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use kube::runtime::reflector::ObjectRef;

use super::Trigger;
use crate::crd::InferenceDeployment;
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

/// The counters, summed by reason, and whether every pod asked about answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counters {
    pub by_reason: BTreeMap<String, u64>,
    pub complete: bool,
}

struct Scraped {
    targets: Vec<Endpoint>,
    latest: Option<(Vec<Endpoint>, BTreeMap<String, u64>)>,
    wanted: Instant,
}

impl Default for Scraped {
    fn default() -> Self {
        Scraped { targets: Vec::new(), latest: None, wanted: Instant::now() }
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
            let (answered, by_reason) = entry.get::<Scraped>()?.latest.as_ref()?;
            Some(Counters { by_reason: by_reason.clone(), complete: *answered == targets })
        });
        found.flatten()
    }

    /// Keeps `targets` (the deployment's worker pods) scraped.
    pub fn want(self: &Arc<Self>, owner: &ObjectRef<InferenceDeployment>, owner_uid: &str, mut targets: Vec<Endpoint>) {
        targets.sort();
        self.index.with(owner_uid, |entry| {
            if !entry.running(TASK, "") {
                entry.spawn(TASK, "", self.clone().run(owner.clone(), owner_uid.to_string()));
            }
            let s = entry.part::<Scraped>();
            (s.targets, s.wanted) = (targets, Instant::now());
        });
    }

    async fn run(self: Arc<Self>, owner: ObjectRef<InferenceDeployment>, uid: String) {
        loop {
            let targets = self.index.with(&uid, |entry| match entry.get::<Scraped>() {
                Some(s) if s.wanted.elapsed() < IDLE => Some(s.targets.clone()),
                _ => {
                    entry.drop_part::<Scraped>();
                    None
                }
            });
            let Some(Some(targets)) = targets else { return };
            let reads = join_all(targets.iter().map(|(ip, port)| scrape::metrics(&self.http, ip, *port))).await;
            let mut answered = Vec::new();
            let mut by_reason = BTreeMap::new();
            for (target, text) in targets.iter().zip(reads) {
                let Ok(text) = text else { continue };
                answered.push(target.clone());
                for (reason, n) in scrape::family_by(&text, scrape::MISMATCHES, "reason") {
                    *by_reason.entry(reason).or_insert(0) += n as u64;
                }
            }
            let changed = self.index.with(&uid, |entry| {
                let s = entry.part::<Scraped>();
                let changed = s.latest.as_ref().is_none_or(|(_, before)| *before != by_reason);
                if !answered.is_empty() || targets.is_empty() {
                    s.latest = Some((answered, by_reason));
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
