//! The deployment's integrity counters, scraped in the background: every KV pod's counters of
//! its engine (`engines::integrity`: kvgate's `kvgate_handoff_mismatch_total` by reason; a
//! disaggregated vLLM's connector mismatches, NIXL failures and reads after expiry too), kept by
//! pod, with each pod's violation in progress (`counter_watch`). Twice a second while a promotion
//! or a bake needs them (a bake rolls back within one scrape of a mismatch), every
//! `SERVING_EVERY` while a revision just serves. A change wakes the reconcile; a deployment
//! nobody asked about for `IDLE` is no longer scraped. The counters are a part of the
//! deployment's index entry, the loop its `scrape` task.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use kube::runtime::reflector::ObjectRef;

use super::Trigger;
use super::counter_watch::CounterWatch;
use crate::crd::InferenceDeployment;
use crate::engines::integrity::{self, Counter, Counts};
use crate::index::Index;
use crate::index::TaskKind;
use crate::scrape;

/// Every pod's `/metrics` is a few hundred bytes of text: cheap enough to read twice a second
/// while a bake lasts, and a rollback follows a mismatch within about half a second.
pub const EVERY: Duration = Duration::from_millis(500);
/// While a revision serves with no bake: a violation is reported within five seconds, and a
/// hundred pods cost twenty small reads a second.
pub const SERVING_EVERY: Duration = Duration::from_secs(5);
const TASK: TaskKind = TaskKind::Scrape;
/// Longer than the slowest requeue of a settled deployment (30 s), which asks again each pass.
const IDLE: Duration = Duration::from_secs(60);

/// How a deployment's counters are read: how often, and how long a pod's counters must hold
/// still after they grew before its violation ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    pub every: Duration,
    pub quiet: Duration,
}

/// A pod's address and the port of its `/metrics`.
pub type Endpoint = (String, u16);

/// The counters of every pod that answered, and whether every pod asked about answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counters {
    pub by_pod: BTreeMap<Endpoint, Counts>,
    pub complete: bool,
    /// Each pod in a violation: what grew since it started (`counter_watch`).
    pub violations: BTreeMap<Endpoint, Vec<String>>,
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
    pace: Pace,
    latest: Option<BTreeMap<Endpoint, Counts>>,
    watches: BTreeMap<Endpoint, CounterWatch>,
    wanted: Instant,
}

impl Default for Scraped {
    fn default() -> Self {
        let pace = Pace { every: EVERY, quiet: Duration::from_secs(300) };
        Scraped { targets: Vec::new(), counters: &[], pace, latest: None, watches: BTreeMap::new(), wanted: Instant::now() }
    }
}

impl Scraped {
    /// Takes the reads of one round (the pods that answered) and ends the violations that held
    /// still; forgets the pods no longer asked about.
    fn take(&mut self, by_pod: &BTreeMap<Endpoint, Counts>, now: Instant) {
        // `want` keeps the targets sorted.
        self.watches.retain(|ep, _| self.targets.binary_search(ep).is_ok());
        for (ep, counts) in by_pod {
            match self.watches.get_mut(ep) {
                Some(w) => w.read(counts.clone(), now),
                None => {
                    self.watches.insert(ep.clone(), CounterWatch::new(counts.clone()));
                }
            }
        }
        self.watches.values_mut().for_each(|w| w.expire(now, self.pace.quiet));
    }

    fn violations(&self) -> BTreeMap<Endpoint, Vec<String>> {
        self.watches.iter().map(|(ep, w)| (ep.clone(), w.grown())).filter(|(_, g)| !g.is_empty()).collect()
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
            let s = entry.get::<Scraped>()?;
            let by_pod = s.latest.as_ref()?;
            Some(Counters { by_pod: by_pod.clone(), complete: by_pod.keys().eq(targets.iter()), violations: s.violations() })
        });
        found.flatten()
    }

    /// Keeps `counters` of `targets` (the deployment's KV pods) scraped at `pace`.
    pub fn want(
        self: &Arc<Self>,
        owner: &ObjectRef<InferenceDeployment>,
        owner_uid: &str,
        mut targets: Vec<Endpoint>,
        counters: &'static [Counter],
        pace: Pace,
    ) {
        targets.sort();
        self.index.with(owner_uid, |entry| {
            if !entry.running(TASK, "") {
                entry.spawn(TASK, "", self.clone().run(owner.clone(), owner_uid.to_string()));
            }
            let s = entry.part::<Scraped>();
            (s.targets, s.counters, s.pace, s.wanted) = (targets, counters, pace, Instant::now());
        });
    }

    async fn run(self: Arc<Self>, owner: ObjectRef<InferenceDeployment>, uid: String) {
        loop {
            let targets = self.index.with(&uid, |entry| match entry.get::<Scraped>() {
                Some(s) if s.wanted.elapsed() < IDLE => Some((s.targets.clone(), s.counters, s.pace.every)),
                _ => {
                    entry.drop_part::<Scraped>();
                    None
                }
            });
            let Some(Some((targets, counters, every))) = targets else { return };
            let reads = join_all(targets.iter().map(|(ip, port)| scrape::metrics(&self.http, ip, *port))).await;
            let by_pod: BTreeMap<Endpoint, Counts> =
                targets.iter().zip(reads).filter_map(|(target, text)| Some((target.clone(), integrity::read(&text.ok()?, counters)))).collect();
            let changed = self.index.with(&uid, |entry| {
                let s = entry.part::<Scraped>();
                let violations = s.violations();
                s.take(&by_pod, Instant::now());
                let changed = s.latest.as_ref() != Some(&by_pod) || s.violations() != violations;
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
            tokio::time::sleep(every).await;
        }
    }
}
