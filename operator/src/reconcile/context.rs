//! What every step of a pass reaches: the operator's `Context` (client, stores, index, tasks,
//! metrics, settings), the `Error` a pass fails with (its Event reason and retry schedule), and
//! the Events it publishes.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder};

use crate::index::Index;
use crate::keys::RootKey;
use crate::metrics::Metrics;
use crate::reasons::{EventAction, Reason};
use crate::tasks::canaries::Canaries;
use crate::tasks::probes::Probes;
use crate::tasks::scrapes::Scrapes;
use crate::tasks::serving_probes::ServingProbes;
use crate::watch::Stores;

use super::memory::Memory;

/// How the operator renders the pods it owns.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The worker image of deployments that name none.
    pub worker_image: String,
    /// How the worker pods log (`--log-format`) and where they export spans.
    pub worker_telemetry: crate::render::workers::Telemetry,
    /// Node directories a hostPath model may be under (see `host_paths`).
    pub allowed_host_paths: Vec<String>,
}

pub struct Context {
    pub client: kube::Client,
    pub metrics: Metrics,
    pub recorder: Recorder,
    pub settings: Settings,
    /// Every deployment's handoff secret derives from it (`keys`).
    pub root: RootKey,
    pub stores: Stores,
    /// One entry per deployment: its memory, its tasks' state and handles.
    pub index: Arc<Index>,
    pub probes: Arc<Probes>,
    pub scrapes: Arc<Scrapes>,
    pub canaries: Arc<Canaries>,
    pub serving_probes: Arc<ServingProbes>,
    pub memory: Memory,
    /// Wakes a deployment's next pass (what apply found changed the next decision).
    pub trigger: crate::tasks::Trigger,
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
    pub fn reason(&self) -> Reason {
        match self {
            Error::Forbidden { .. } => Reason::Forbidden,
            Error::Conflict { .. } => Reason::Conflict,
            Error::Rejected { .. } => Reason::ObjectRejected,
            Error::Api { .. } => Reason::ApiUnavailable,
        }
    }

    /// When to retry after `failures` consecutive failures: a conflict at once, an outage with
    /// exponential back-off, what needs a person at least a minute apart.
    pub fn retry_after(&self, failures: u32) -> Duration {
        match self {
            Error::Conflict { .. } => Duration::from_secs(1),
            Error::Api { .. } => backoff(failures),
            Error::Forbidden { .. } | Error::Rejected { .. } => backoff(failures).max(Duration::from_secs(60)),
        }
    }
}

pub async fn event(ctx: &Context, reference: &ObjectReference, type_: EventType, reason: Reason, action: EventAction, note: String) {
    let ev = Event { type_, reason: reason.as_str().into(), note: Some(note), action: action.as_str().into(), secondary: None };
    if let Err(e) = ctx.recorder.publish(&ev, reference).await {
        tracing::warn!(error = %e, %reason, "could not publish an event");
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
            assert_eq!((e.reason().as_str(), e.retry_after(1).as_secs(), e.retry_after(3).as_secs()), (reason, first, third), "HTTP {code}");
            assert!(e.to_string().starts_with("applying Deployment x"), "{e}");
        }
    }
}
