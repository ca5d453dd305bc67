//! In-cluster peer discovery: the router watches the EndpointSlices of the prefill and decode
//! Services and keeps its peers equal to their ready endpoints. A pod is ready there only once
//! the operator has verified its KV pool (the `kvgate.dev/kv-pool-verified` readiness gate), so
//! unverified pods get no traffic. One watch, no polling: a readiness change reaches the router
//! as soon as the API server publishes it.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};

use super::peers::Peers;
use kvgate_proto::contract::KvRole;

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

/// The User-Agent of the router's requests to the API server.
pub const USER_AGENT: &str = concat!("kvgate-router/", env!("CARGO_PKG_VERSION"));

/// The label EndpointSlices carry with their Service's name.
const SERVICE_NAME: &str = "kubernetes.io/service-name";

/// Watches both Services' EndpointSlices and keeps `peers` equal to their ready endpoints.
pub async fn run(client: kube::Client, services: Services, peers: Arc<Peers>, http: reqwest::Client) {
    let api: Api<EndpointSlice> = Api::namespaced(client, &services.namespace);
    let selector = format!("{SERVICE_NAME} in ({},{})", services.prefill, services.decode);
    let (store, writer) = reflector::store();
    let events = watcher(api, watcher::Config::default().labels(&selector)).default_backoff().reflect(writer);
    let mut events = std::pin::pin!(events);
    while let Some(event) = events.next().await {
        match event {
            // Mid-relist the store is partial: wait for the whole list before acting on it.
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
            Ok(_) => update(&store, &services, &peers, &http).await,
            Err(e) => tracing::warn!(error = %e, "watching EndpointSlices failed; keeping the last peers while it resumes"),
        }
    }
}

/// Sets each role's peers from the slices of its Service.
async fn update(store: &Store<EndpointSlice>, services: &Services, peers: &Peers, http: &reqwest::Client) {
    let slices = store.state();
    for (role, service) in [(KvRole::Prefill, &services.prefill), (KvRole::Decode, &services.decode)] {
        let mine: Vec<EndpointSlice> =
            slices.iter().filter(|s| s.metadata.labels.as_ref().and_then(|l| l.get(SERVICE_NAME)) == Some(service)).map(|s| (**s).clone()).collect();
        let added = peers.set(role, &ready_addresses(&mine));
        if !added.is_empty() {
            tracing::info!(service, peers = ?added.iter().map(|p| p.base.clone()).collect::<Vec<_>>(), "discovered peers");
            for peer in &added {
                peer.refresh(http).await;
            }
        }
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
