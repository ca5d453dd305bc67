//! Integrity canaries, one background run per deployment and candidate revision. A reconcile
//! asks for the run its plan wants and reads its result once it finished; a new candidate
//! revision (or the deployment's deletion) cancels the run of the one before. The run's revision
//! and result are a part of the deployment's index entry, the run its `canary` task.

use std::sync::Arc;
use std::time::Instant;
use tracing::Instrument;

use kube::runtime::reflector::ObjectRef;
use kvgate_proto::auth::DeploymentKey;

use super::Trigger;
use crate::canary::{self, CanaryRun};
use crate::crd::{CanaryStatus, InferenceDeployment};
use crate::index::Index;
use crate::index::TaskKind;
use crate::metrics::Metrics;

const TASK: TaskKind = TaskKind::Canary;

/// The revision whose run was started last, and its result once it finished.
#[derive(Default)]
struct Run {
    revision: String,
    result: Option<CanaryStatus>,
}

pub struct Canaries {
    http: reqwest::Client,
    trigger: Trigger,
    metrics: Metrics,
    index: Arc<Index>,
}

impl Canaries {
    pub fn new(http: reqwest::Client, trigger: Trigger, metrics: Metrics, index: Arc<Index>) -> Arc<Self> {
        Arc::new(Canaries { http, trigger, metrics, index })
    }

    /// The finished run of `revision`, if there is one.
    pub fn result(&self, owner_uid: &str, revision: &str) -> Option<CanaryStatus> {
        self.index.with(owner_uid, |e| e.get::<Run>().filter(|r| r.revision == revision).and_then(|r| r.result.clone())).flatten()
    }

    /// Starts `run` unless it runs (or ran) already; a run of another revision is cancelled.
    pub fn start(self: &Arc<Self>, owner: &ObjectRef<InferenceDeployment>, owner_uid: &str, run: &CanaryRun, key: Option<DeploymentKey>) {
        self.index.with(owner_uid, |entry| {
            let current = entry.part::<Run>();
            if current.revision == run.revision {
                return;
            }
            *current = Run { revision: run.revision.clone(), result: None };
            tracing::info!(name = owner.name, namespace = owner.namespace, revision = run.revision, "integrity canary");
            // Its own trace: the canary's calls carry it, so the candidate pods' spans join it.
            let span = tracing::info_span!(
                parent: None, "canary", deployment = owner.name, namespace = owner.namespace, revision = run.revision, passed = tracing::field::Empty
            );
            entry.spawn(TASK, "", self.clone().run(owner.clone(), owner_uid.to_string(), run.clone(), key).instrument(span));
        });
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
        let recorded = self.index.with(&uid, |e| e.get::<Run>().filter(|r| r.revision == run.revision).map(|r| r.result = Some(result)));
        if recorded.flatten().is_some() {
            self.trigger.reconcile(&owner);
        }
    }
}
