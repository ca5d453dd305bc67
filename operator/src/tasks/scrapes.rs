//! The deployment's handoff mismatch counters, scraped in the background while a promotion or a
//! bake needs them: every `EVERY`, every worker pod's `kvgate_handoff_mismatch_total` summed by
//! reason. A change wakes the reconcile (a bake rolls back within one scrape of a mismatch); a
//! deployment nobody asked about for `IDLE` is no longer scraped.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use kube::runtime::reflector::ObjectRef;

use super::Trigger;
use crate::crd::InferenceDeployment;
use crate::scrape;

pub const EVERY: Duration = Duration::from_secs(2);
const IDLE: Duration = Duration::from_secs(10);

/// A pod's address and the port of its `/metrics`.
pub type Endpoint = (String, u16);

/// The counters, summed by reason, and whether every pod asked about answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counters {
    pub by_reason: BTreeMap<String, u64>,
    pub complete: bool,
}

struct Entry {
    targets: Vec<Endpoint>,
    latest: Option<(Vec<Endpoint>, BTreeMap<String, u64>)>,
    wanted: Instant,
}

pub struct Scrapes {
    http: reqwest::Client,
    trigger: Trigger,
    entries: Mutex<HashMap<String, Entry>>,
}

impl Scrapes {
    pub fn new(http: reqwest::Client, trigger: Trigger) -> Arc<Self> {
        Arc::new(Scrapes { http, trigger, entries: Mutex::default() })
    }

    /// The latest counters of `targets` (the deployment's worker pods); keeps them scraped.
    pub fn want(self: &Arc<Self>, owner: &ObjectRef<InferenceDeployment>, owner_uid: &str, mut targets: Vec<Endpoint>) -> Option<Counters> {
        targets.sort();
        let mut entries = self.entries.lock().unwrap();
        let e = match entries.get_mut(owner_uid) {
            Some(e) => e,
            None => {
                tokio::spawn(self.clone().run(owner.clone(), owner_uid.to_string()));
                entries.entry(owner_uid.to_string()).or_insert(Entry { targets: Vec::new(), latest: None, wanted: Instant::now() })
            }
        };
        e.targets = targets;
        e.wanted = Instant::now();
        let (answered, by_reason) = e.latest.as_ref()?;
        Some(Counters { by_reason: by_reason.clone(), complete: *answered == e.targets })
    }

    async fn run(self: Arc<Self>, owner: ObjectRef<InferenceDeployment>, uid: String) {
        loop {
            let targets = {
                let mut entries = self.entries.lock().unwrap();
                match entries.get(&uid) {
                    Some(e) if e.wanted.elapsed() < IDLE => e.targets.clone(),
                    _ => {
                        entries.remove(&uid);
                        return;
                    }
                }
            };
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
            let changed = {
                let mut entries = self.entries.lock().unwrap();
                let Some(e) = entries.get_mut(&uid) else { return };
                let changed = e.latest.as_ref().is_none_or(|(_, before)| *before != by_reason);
                if !answered.is_empty() || targets.is_empty() {
                    e.latest = Some((answered, by_reason));
                }
                changed
            };
            if changed {
                self.trigger.reconcile(&owner);
            }
            tokio::time::sleep(EVERY).await;
        }
    }

    /// Stops scraping a deployment (deleted).
    pub fn forget(&self, owner_uid: &str) {
        self.entries.lock().unwrap().remove(owner_uid);
    }
}
