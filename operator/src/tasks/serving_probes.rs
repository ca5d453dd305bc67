//! The probes on serving pods, at a rate, beside their live traffic: every
//! `boundaryProbe.servingEverySeconds`, each serving pair or pod must still refuse a prompt of
//! the window + 1 with a 4xx, and the reference prompt must give what that pair or pod gave the
//! first time this process asked it (live traffic has filled its pool since: an engine reading
//! pages other requests wrote answers otherwise). A round is skipped when it would take the
//! prompt tokens computed in the last hour past `maxPrefillTokensPerHour`. What a round catches
//! takes the pods out of traffic (the gate) until a round passes again; a change wakes the
//! deployment's reconcile.
//!
//! The first answers are this process's memory (a part of the deployment's index entry; each
//! round its `serving-probe` task): a restarted operator takes them again.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::runtime::reflector::ObjectRef;
use kvgate_proto::auth::DeploymentKey;

use super::Trigger;
use crate::canary::{self, ServingRun};
use crate::crd::InferenceDeployment;
use crate::index::Index;
use crate::index::TaskKind;
use crate::metrics::Metrics;
use crate::rollout_state::RefusalReason;

const HOUR: Duration = Duration::from_secs(3600);
const TASK: TaskKind = TaskKind::ServingProbe;

/// Why a serving pod fails the probes: the refusal reason its gate shows, and the message.
pub type Failures = BTreeMap<String, (RefusalReason, String)>;

struct Probing {
    run: ServingRun,
    key: Option<DeploymentKey>,
    /// Each unit's first answer to the reference prompt.
    first: HashMap<String, Vec<u32>>,
    failures: Failures,
    /// Prompt tokens engines computed for the rounds, when.
    spent: VecDeque<(Instant, u64)>,
    last: Option<Instant>,
    in_flight: bool,
}

/// A deployment's probing, once it serves.
#[derive(Default)]
struct Serving(Option<Probing>);

pub struct ServingProbes {
    http: reqwest::Client,
    trigger: Trigger,
    metrics: Metrics,
    index: Arc<Index>,
}

impl ServingProbes {
    pub fn new(http: reqwest::Client, trigger: Trigger, metrics: Metrics, index: Arc<Index>) -> Arc<Self> {
        Arc::new(ServingProbes { http, trigger, metrics, index })
    }

    /// What the probes found on `revision`'s pods (empty before a round failed anything).
    pub fn failures(&self, owner_uid: &str, revision: &str) -> Failures {
        let found = self.index.with(owner_uid, |e| e.get::<Serving>()?.0.as_ref().filter(|p| p.run.revision == revision).map(|p| p.failures.clone()));
        found.flatten().unwrap_or_default()
    }

    /// Keeps `run` going (a new revision or target replaces the one before); starts a round
    /// when one is due.
    pub fn want(self: &Arc<Self>, owner: &ObjectRef<InferenceDeployment>, owner_uid: &str, run: &ServingRun, key: Option<DeploymentKey>) {
        self.index.with(owner_uid, |entry| {
            let e = entry.part::<Serving>().0.get_or_insert_with(|| Probing {
                run: run.clone(),
                key: key.clone(),
                first: HashMap::new(),
                failures: Failures::new(),
                spent: VecDeque::new(),
                last: None,
                in_flight: false,
            });
            if e.run.revision != run.revision || e.run.reference != run.reference {
                e.first.clear();
                e.failures.clear();
            }
            e.run = run.clone();
            e.key = key;
            let due = e.last.is_none_or(|at| at.elapsed() >= Duration::from_secs(run.every_seconds.max(1)));
            if !due || e.in_flight {
                return;
            }
            // The budget: what the last hour computed, and what an honest round computes (the
            // reference prompt on every unit; a refused probe computes nothing).
            while e.spent.front().is_some_and(|(at, _)| at.elapsed() >= HOUR) {
                e.spent.pop_front();
            }
            let spent: u64 = e.spent.iter().map(|(_, t)| t).sum();
            let units = run.target.unit_count();
            e.last = Some(Instant::now());
            if spent + (units * run.reference.len()) as u64 > run.max_tokens_per_hour {
                tracing::info!(name = owner.name, namespace = owner.namespace, spent, "serving probes: round skipped, over maxPrefillTokensPerHour");
                return;
            }
            e.in_flight = true;
            entry.spawn(TASK, "", self.clone().round(owner.clone(), owner_uid.to_string()));
        });
    }

    async fn round(self: Arc<Self>, owner: ObjectRef<InferenceDeployment>, uid: String) {
        let found = self.index.with(&uid, |e| e.get::<Serving>()?.0.as_ref().map(|p| (p.run.clone(), p.key.clone(), p.first.clone())));
        let Some(Some((run, key, first))) = found else { return };
        let round = canary::serving_round(&self.http, key.as_ref(), &run, &first).await;
        let mut failures = Failures::new();
        for c in &round.caught {
            self.metrics.probe_mismatches.with_label_values(&[c.mismatch.engine.as_str(), c.mismatch.role, c.mismatch.probe.into()]).inc();
            tracing::warn!(name = owner.name, namespace = owner.namespace, revision = run.revision, message = c.message, "serving probe caught a pod");
            for pod in &c.pods {
                failures.insert(pod.clone(), (c.reason, c.message.clone()));
            }
        }
        let changed = self.index.with(&uid, |entry| {
            // Forgotten (deleted) or moved to another revision meanwhile: this round is moot.
            let e = entry.get::<Serving>()?.0.as_mut().filter(|p| p.run.revision == run.revision)?;
            e.in_flight = false;
            e.spent.push_back((Instant::now(), round.computed_tokens));
            for (unit, answer) in round.answers {
                e.first.entry(unit).or_insert(answer);
            }
            let changed = e.failures != failures;
            e.failures = failures;
            Some(changed)
        });
        if changed.flatten() == Some(true) {
            self.trigger.reconcile(&owner);
        }
    }

    /// Stops probing a deployment that no longer serves.
    pub fn stop(&self, owner_uid: &str) {
        self.index.with(owner_uid, |entry| {
            entry.drop_part::<Serving>();
            entry.stop(TASK, "");
        });
    }
}
