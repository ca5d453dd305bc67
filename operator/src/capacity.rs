//! Reading a pod's capacity report (`GET /v1/kv-pool` on its IP).

use std::time::Duration;

use kvgate_proto::{CapacityReport, KV_POOL_PATH};

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().connect_timeout(Duration::from_secs(2)).timeout(Duration::from_secs(5)).build().expect("HTTP client")
}

/// The report, or why there is none yet (not listening yet, not a kvgate worker).
pub async fn read(http: &reqwest::Client, ip: &str, port: i32) -> Result<CapacityReport, String> {
    let url = format!("http://{ip}:{port}{KV_POOL_PATH}");
    let resp = http.get(&url).send().await.map_err(|e| format!("{url}: {e}"))?;
    let resp = resp.error_for_status().map_err(|e| format!("{url}: {e}"))?;
    resp.json::<CapacityReport>().await.map_err(|e| format!("{url}: not a capacity report: {e}"))
}
