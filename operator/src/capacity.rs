//! Reading a pod's capacity report (`GET /v1/kv-pool?nonce=...` on its IP), signed.
//!
//! Every read sends a fresh random nonce; the worker answers with the report and a MAC over the
//! nonce, its pod's name and the body, keyed by the deployment's handoff secret
//! (`DeploymentKey::report_mac`). A report is accepted only when that MAC verifies for the pod
//! the operator asked: another process on the pod's address, a pod of another deployment
//! (another secret), another pod of this one, or a replayed answer cannot get a pod verified.

use std::time::Duration;

use kvgate_proto::auth::{DeploymentKey, Mac, REPORT_MAC_HEADER};
use kvgate_proto::{CapacityReport, KV_POOL_PATH};

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().connect_timeout(Duration::from_secs(2)).timeout(Duration::from_secs(5)).build().expect("HTTP client")
}

/// Why a pod has no verified report: not running yet, unreachable, not a report, or one that
/// does not verify as this pod's (`reason` is the gate condition's).
#[derive(Debug, Clone, PartialEq)]
pub struct NoReport {
    pub reason: NoReportReason,
    pub message: String,
}

/// The gate condition's reason for a pod without a verified report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr)]
pub enum NoReportReason {
    /// Not running, not answering, or not read yet: it may still come.
    #[strum(serialize = "AwaitingCapacityReport")]
    Awaiting,
    /// A report that does not verify as this pod's (forged, or signed with another key).
    #[strum(serialize = "UnauthenticatedReport")]
    Unauthenticated,
    /// An external engine answered, but not with the capacity its adapter reads.
    #[strum(serialize = "CapacityUnreadable")]
    Unreadable,
}

impl NoReportReason {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

impl NoReport {
    pub fn waiting(message: impl Into<String>) -> Self {
        NoReport { reason: NoReportReason::Awaiting, message: message.into() }
    }
}

impl From<ReportError> for NoReport {
    fn from(e: ReportError) -> Self {
        NoReport { reason: e.reason(), message: e.to_string() }
    }
}

/// Why a pod has no report yet (not listening yet, not a kvgate worker, not this deployment's);
/// shown in the pod's gate condition.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("GET {url}: {}", cause(.source))]
    Unreachable { url: String, source: reqwest::Error },
    #[error("GET {url}: HTTP {status}")]
    Status { url: String, status: reqwest::StatusCode },
    #[error("GET {url}: not a capacity report: {why}")]
    NotAReport { url: String, why: String },
    #[error(
        "GET {url}: the report does not verify as pod {pod}'s, signed with this deployment's handoff secret ({why}); whatever answers there is not this pod's kvgate worker"
    )]
    Unauthenticated { url: String, pod: String, why: &'static str },
}

impl ReportError {
    /// The gate condition's reason for a pod whose report is refused or missing.
    pub fn reason(&self) -> NoReportReason {
        match self {
            ReportError::Unauthenticated { .. } => NoReportReason::Unauthenticated,
            _ => NoReportReason::Awaiting,
        }
    }
}

/// The innermost cause (e.g. `connection refused`), not reqwest's generic outer text.
pub fn cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut inner = e;
    while let Some(next) = inner.source() {
        inner = next;
    }
    inner.to_string()
}

/// Reads pod `pod`'s report from `ip:port` and accepts it only with a valid MAC under `key`.
pub async fn read(http: &reqwest::Client, ip: &str, port: u16, pod: &str, key: &DeploymentKey) -> Result<CapacityReport, ReportError> {
    let nonce: u128 = rand::random();
    let url = format!("http://{ip}:{port}{KV_POOL_PATH}");
    let resp = http.get(format!("{url}?nonce={nonce:032x}")).send().await.map_err(|source| ReportError::Unreachable { url: url.clone(), source })?;
    if !resp.status().is_success() {
        return Err(ReportError::Status { status: resp.status(), url });
    }
    let unauthenticated = |why| ReportError::Unauthenticated { url: url.clone(), pod: pod.to_string(), why };
    let mac = resp.headers().get(REPORT_MAC_HEADER).ok_or_else(|| unauthenticated("no MAC header"))?;
    let mac = mac.to_str().ok().and_then(|m| Mac::from_hex(m).ok()).ok_or_else(|| unauthenticated("a malformed MAC"))?;
    let body = resp.bytes().await.map_err(|e| ReportError::NotAReport { url: url.clone(), why: cause(&e) })?;
    if !key.report_mac(nonce, pod, &body).verify(&mac) {
        return Err(unauthenticated("the MAC does not match"));
    }
    serde_json::from_slice(&body).map_err(|e| ReportError::NotAReport { url, why: e.to_string() })
}
