//! Integrity canaries, one background run per deployment and candidate revision. A reconcile
//! asks for the run its plan wants and reads its result once it finished; a new candidate
//! revision (or the deployment's deletion) cancels the run of the one before.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tracing::Instrument;

use kube::runtime::reflector::ObjectRef;
use kvgate_proto::auth::DeploymentKey;

use super::Trigger;
use crate::canary::{self, CanaryRun};
use crate::crd::{CanaryStatus, InferenceDeployment};
use crate::metrics::Metrics;

struct Entry {
    revision: String,
    result: Option<CanaryStatus>,
    task: tokio::task::JoinHandle<()>,
}

pub struct Canaries {
    http: reqwest::Client,
    trigger: Trigger,
    metrics: Metrics,
    entries: Mutex<HashMap<String, Entry>>,
}

impl Canaries {
    pub fn new(http: reqwest::Client, trigger: Trigger, metrics: Metrics) -> Arc<Self> {
        Arc::new(Canaries { http, trigger, metrics, entries: Mutex::default() })
    }

    /// The finished run of `revision`, if there is one.
    pub fn result(&self, owner_uid: &str, revision: &str) -> Option<CanaryStatus> {
        self.entries.lock().unwrap().get(owner_uid).filter(|e| e.revision == revision).and_then(|e| e.result.clone())
    }

    /// Starts `run` unless it runs (or ran) already.
    pub fn start(self: &Arc<Self>, owner: &ObjectRef<InferenceDeployment>, owner_uid: &str, run: &CanaryRun, key: Option<DeploymentKey>) {
        let mut entries = self.entries.lock().unwrap();
        if entries.get(owner_uid).is_some_and(|e| e.revision == run.revision) {
            return;
        }
        if let Some(old) = entries.remove(owner_uid) {
            old.task.abort();
        }
        tracing::info!(name = owner.name, namespace = owner.namespace, revision = run.revision, "integrity canary");
        // Its own trace: the canary's calls carry it, so the candidate pods' spans join it.
        let span = tracing::info_span!(parent: None, "canary", deployment = owner.name, namespace = owner.namespace, revision = run.revision, passed = tracing::field::Empty);
        let task = tokio::spawn(self.clone().run(owner.clone(), owner_uid.to_string(), run.clone(), key).instrument(span));
        entries.insert(owner_uid.to_string(), Entry { revision: run.revision.clone(), result: None, task });
    }

    async fn run(self: Arc<Self>, owner: ObjectRef<InferenceDeployment>, uid: String, run: CanaryRun, key: Option<DeploymentKey>) {
        let started = Instant::now();
        let (result, caught) = canary::run(&self.http, key.as_ref(), &run).await;
        if let Some(c) = caught {
            self.metrics.probe_mismatches.with_label_values(&[c.engine.as_str(), c.role, c.probe.into()]).inc();
        }
        tracing::Span::current().record("passed", result.passed);
        self.metrics.canary_duration.observe(started.elapsed().as_secs_f64());
        self.metrics.canaries.with_label_values(&[if result.passed { "passed" } else { "failed" }]).inc();
        if let Some(e) = self.entries.lock().unwrap().get_mut(&uid).filter(|e| e.revision == run.revision) {
            e.result = Some(result);
        }
        self.trigger.reconcile(&owner);
    }

    /// Cancels a deployment's run (deleted).
    pub fn forget(&self, owner_uid: &str) {
        if let Some(e) = self.entries.lock().unwrap().remove(owner_uid) {
            e.task.abort();
        }
    }
}
