//! `kvgate-operator check`: what the chart's `helm test` runs. It finds the ready endpoints of a
//! Service through its EndpointSlices (no cluster DNS or Service proxy needed) and asks each for
//! a path over HTTP; it passes when every ready endpoint answers 200 and there is at least one.

use std::time::Duration;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};

/// Checks `path` on port `port_name` of every ready endpoint of Service `service` in
/// `namespace`; prints one line per endpoint.
pub async fn check(service: &str, namespace: &str, port_name: &str, path: &str, timeout: Duration) -> anyhow::Result<()> {
    let client = kube::Client::try_default().await?;
    let slices: Api<EndpointSlice> = Api::namespaced(client, namespace);
    let list = slices.list(&ListParams::default().labels(&format!("kubernetes.io/service-name={service}"))).await?;
    let http = reqwest::Client::builder().timeout(timeout).build()?;
    let mut checked = 0;
    for slice in &list.items {
        let Some(port) = slice.ports.iter().flatten().find(|p| p.name.as_deref() == Some(port_name)).and_then(|p| p.port) else { continue };
        for endpoint in slice.endpoints.iter().flatten() {
            if endpoint.conditions.as_ref().and_then(|c| c.ready) != Some(true) {
                continue;
            }
            for address in &endpoint.addresses {
                let host = if address.contains(':') { format!("[{address}]") } else { address.clone() };
                let url = format!("http://{host}:{port}{path}");
                let status = http.get(&url).send().await.map_err(|e| anyhow::anyhow!("GET {url}: {e}"))?.status();
                anyhow::ensure!(status == reqwest::StatusCode::OK, "GET {url}: {status}");
                println!("GET {url}: {status}");
                checked += 1;
            }
        }
    }
    anyhow::ensure!(checked > 0, "Service {namespace}/{service} has no ready endpoint with a port named {port_name}");
    Ok(())
}
