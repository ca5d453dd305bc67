//! The reconciler: level-triggered and idempotent. Each pass is `rollout::reconcile`: observe
//! (reads only) -> decide (pure) -> apply (server-side apply with one field manager: applying what
//! is already there writes nothing; status only when it changed).

pub mod apply;
pub mod bake;
pub mod decide;
pub mod observe;
pub mod rollout;
pub mod status;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Resource, ResourceExt};

use crate::crd::InferenceDeployment;
use crate::metrics::Metrics;

/// The field manager of everything the operator writes.
pub const MANAGER: &str = "kvgate-operator";

pub struct Context {
    pub client: kube::Client,
    pub http: reqwest::Client,
    pub metrics: Metrics,
    pub recorder: Recorder,
    pub worker_image: String,
    /// `--log-format` of the worker pods it renders.
    pub worker_log_format: kvgate_telemetry::LogFormat,
    /// Node directories a hostPath model may be under (see `host_paths`).
    pub allowed_host_paths: Vec<String>,
    /// Consecutive failures per object, for the retry backoff.
    pub failures: Mutex<HashMap<String, u32>>,
    /// Generated handoff Secrets known to exist (`namespace/name`), learnt from the operator's own
    /// create (or its 409), so each is created once.
    pub secrets_created: Mutex<std::collections::HashSet<String>>,
}

impl Context {
    pub fn new(client: kube::Client, metrics: Metrics, recorder: Recorder, worker_image: String, allowed_host_paths: Vec<String>) -> Self {
        Context {
            client,
            http: crate::capacity::client(),
            metrics,
            recorder,
            worker_image,
            worker_log_format: kvgate_telemetry::LogFormat::Json,
            allowed_host_paths,
            failures: Mutex::default(),
            secrets_created: Mutex::default(),
        }
    }
}

fn key(d: &InferenceDeployment) -> String {
    format!("{}/{}", d.namespace().unwrap_or_default(), d.name_any())
}

/// 1 s, 2 s, 4 s ... up to 256 s after consecutive failures.
pub fn backoff(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.saturating_sub(1).min(8))
}

/// Why a reconcile failed. Each variant has its own Event reason and retry schedule.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused the operator's credentials or RBAC (401/403): retrying soon does
    /// not help until someone fixes the ServiceAccount's permissions.
    #[error("{what}: forbidden: {source}")]
    Forbidden { what: String, source: kube::Error },
    /// Another writer changed the object in between (409): the next pass re-reads it.
    #[error("{what}: conflict: {source}")]
    Conflict { what: String, source: kube::Error },
    /// The API server rejected an object the operator rendered (400/422: an admission policy or
    /// a bug); it stays rejected until the spec or the policy changes.
    #[error("{what}: rejected: {source}")]
    Rejected { what: String, source: kube::Error },
    /// The API server could not be reached or failed (network, 5xx, timeouts).
    #[error("{what}: {source}")]
    Api { what: String, source: kube::Error },
    /// The integrity canary could not start (its handoff secret is gone).
    #[error("the integrity canary cannot run: {0}")]
    Canary(String),
}

impl Error {
    /// Classifies a failed API call by its status code.
    pub fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let what = what.into();
        move |source| match &source {
            kube::Error::Api(e) if e.code == 401 || e.code == 403 => Error::Forbidden { what, source },
            kube::Error::Api(e) if e.code == 409 => Error::Conflict { what, source },
            kube::Error::Api(e) if e.code == 400 || e.code == 422 => Error::Rejected { what, source },
            _ => Error::Api { what, source },
        }
    }

    /// The reason of the Warning Event a failure publishes.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::Forbidden { .. } => "Forbidden",
            Error::Conflict { .. } => "Conflict",
            Error::Rejected { .. } => "ObjectRejected",
            Error::Api { .. } => "ApiUnavailable",
            Error::Canary(_) => "CanaryNotRun",
        }
    }

    /// When to retry after `failures` consecutive failures: a conflict at once, an outage with
    /// exponential back-off, what needs a person at least a minute apart.
    pub fn retry_after(&self, failures: u32) -> Duration {
        match self {
            Error::Conflict { .. } => Duration::from_secs(1),
            Error::Api { .. } | Error::Canary(_) => backoff(failures),
            Error::Forbidden { .. } | Error::Rejected { .. } => backoff(failures).max(Duration::from_secs(60)),
        }
    }
}

pub async fn reconcile(d: Arc<InferenceDeployment>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = rollout::reconcile(&d, &ctx).await;
    if result.is_ok() {
        ctx.failures.lock().unwrap().remove(&key(&d));
    }
    ctx.metrics.reconcile_duration.observe(started.elapsed().as_secs_f64());
    ctx.metrics.reconciles.with_label_values(&[if result.is_ok() { "success" } else { "error" }]).inc();
    result
}

/// Failed reconciles are retried with exponential backoff and become Warning Events.
pub fn error_policy(d: Arc<InferenceDeployment>, err: &Error, ctx: Arc<Context>) -> Action {
    let failures = {
        let mut map = ctx.failures.lock().unwrap();
        let n = map.entry(key(&d)).or_insert(0);
        *n += 1;
        *n
    };
    let retry = err.retry_after(failures);
    tracing::warn!(name = d.name_any(), namespace = d.namespace(), error = %err, reason = err.reason(), failures, ?retry, "reconcile failed");
    let ctx = ctx.clone();
    let reference = d.object_ref(&());
    let note = err.to_string();
    let reason = err.reason();
    tokio::spawn(async move { event(&ctx, &reference, EventType::Warning, reason, "Reconcile", note).await });
    Action::requeue(retry)
}

pub async fn event(ctx: &Context, reference: &ObjectReference, type_: EventType, reason: &str, action: &str, note: String) {
    let ev = Event { type_, reason: reason.into(), note: Some(note), action: action.into(), secondary: None };
    if let Err(e) = ctx.recorder.publish(&ev, reference).await {
        tracing::warn!(error = %e, reason, "could not publish an event");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_256_seconds() {
        let secs: Vec<u64> = (1..=11).map(|n| super::backoff(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 64, 128, 256, 256, 256]);
    }

    fn status(code: u16) -> kube::Error {
        kube::Error::Api(kube::core::Status::failure("no", "Why").with_code(code).boxed())
    }

    #[test]
    fn each_failure_has_its_reason_and_retry_schedule() {
        let rows = [(403, "Forbidden", 60, 60), (409, "Conflict", 1, 1), (422, "ObjectRejected", 60, 60), (500, "ApiUnavailable", 1, 4)];
        for (code, reason, first, third) in rows {
            let e = Error::api("applying Deployment x")(status(code));
            assert_eq!((e.reason(), e.retry_after(1).as_secs(), e.retry_after(3).as_secs()), (reason, first, third), "HTTP {code}");
            assert!(e.to_string().starts_with("applying Deployment x"), "{e}");
        }
    }
}
