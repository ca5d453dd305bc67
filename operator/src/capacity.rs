//! Reading a pod's capacity report (`GET /v1/kv-pool` on its IP).

use std::time::Duration;

use kvgate_proto::{CapacityReport, KV_POOL_PATH};

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().connect_timeout(Duration::from_secs(2)).timeout(Duration::from_secs(5)).build().expect("HTTP client")
}

/// Why a pod has no report yet (not listening yet, not a kvgate worker); shown in the pod's gate
/// condition.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("GET {url}: {}", cause(.source))]
    Unreachable { url: String, source: reqwest::Error },
    #[error("GET {url}: HTTP {status}")]
    Status { url: String, status: reqwest::StatusCode },
    #[error("GET {url}: not a capacity report: {}", cause(.source))]
    NotAReport { url: String, source: reqwest::Error },
}

/// The innermost cause (e.g. `connection refused`), not reqwest's generic outer text.
fn cause(e: &reqwest::Error) -> String {
    let mut inner: &dyn std::error::Error = e;
    while let Some(next) = inner.source() {
        inner = next;
    }
    inner.to_string()
}

pub async fn read(http: &reqwest::Client, ip: &str, port: u16) -> Result<CapacityReport, ReportError> {
    let url = format!("http://{ip}:{port}{KV_POOL_PATH}");
    let resp = http.get(&url).send().await.map_err(|source| ReportError::Unreachable { url: url.clone(), source })?;
    if !resp.status().is_success() {
        return Err(ReportError::Status { status: resp.status(), url });
    }
    resp.json::<CapacityReport>().await.map_err(|source| ReportError::NotAReport { url, source })
}
