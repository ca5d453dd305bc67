//! In-cluster peer discovery: the router reads the ready endpoints of the prefill and decode
//! Services' EndpointSlices. A pod is ready there only once the operator has verified its KV
//! pool (the `kvgate.dev/kv-pool-verified` readiness gate), so unverified pods get no traffic.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};

use super::peers::{PeerRole, Peers};

/// Where to look.
#[derive(Debug, Clone)]
pub struct Services {
    pub namespace: String,
    pub prefill: String,
    pub decode: String,
}

/// `host:port` of every ready endpoint on the port named `http`.
pub fn ready_addresses(slices: &[EndpointSlice]) -> Vec<String> {
    let mut out: Vec<String> = slices
        .iter()
        .flat_map(|s| {
            let port = s.ports.iter().flatten().find(|p| p.name.as_deref() == Some("http")).and_then(|p| p.port);
            s.endpoints
                .iter()
                .flatten()
                // An unset `ready` means unknown, which the API says to treat as ready.
                .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) != Some(false))
                .flat_map(move |e| e.addresses.iter().filter_map(move |a| port.map(|p| format!("{a}:{p}"))))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Polls the EndpointSlices every `every` and keeps `peers` equal to their ready endpoints.
pub async fn run(client: kube::Client, services: Services, peers: Arc<Peers>, http: reqwest::Client, every: Duration) {
    let api: Api<EndpointSlice> = Api::namespaced(client, &services.namespace);
    loop {
        for (role, service) in [(PeerRole::Prefill, &services.prefill), (PeerRole::Decode, &services.decode)] {
            let lp = ListParams::default().labels(&format!("kubernetes.io/service-name={service}"));
            match api.list(&lp).await {
                Ok(list) => {
                    let added = peers.set(role, &ready_addresses(&list.items));
                    if !added.is_empty() {
                        tracing::info!(service, peers = ?added.iter().map(|p| p.base.clone()).collect::<Vec<_>>(), "discovered peers");
                        for peer in &added {
                            peer.refresh(&http).await;
                        }
                    }
                }
                Err(e) => tracing::warn!(service, error = %e, "listing EndpointSlices failed; keeping the last peers"),
            }
        }
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ready_endpoints_on_the_http_port_are_peers() {
        let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
            "metadata": { "name": "s" }, "addressType": "IPv4",
            "ports": [{ "name": "kv", "port": 8083 }, { "name": "http", "port": 8082 }],
            "endpoints": [
                { "addresses": ["198.18.0.2"], "conditions": { "ready": true } },
                { "addresses": ["198.18.0.3"], "conditions": { "ready": false } },
                { "addresses": ["198.18.0.4"] },
            ],
        }))
        .unwrap();
        assert_eq!(ready_addresses(&[slice]), vec!["198.18.0.2:8082", "198.18.0.4:8082"]);
    }
}
