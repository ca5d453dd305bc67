//! `make dev-cluster`: the test control plane and its nodes (two unless `--nodes` says otherwise)
//! in the foreground, for people.
//! Everything runs in a network namespace of its own; the host reaches it only through relays on
//! 127.0.0.1: the API server (the kubeconfig written to `target/dev-cluster/kubeconfig` points
//! there), the image registry its nodes pull from, and, with `--forward NAMESPACE/SERVICE`, a
//! Service's ready pods. Ctrl-C stops it all.

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};
use kvgate_testenv::ControlPlane;
use kvgate_testenv::relay::{Relay, Target};

kvgate_testenv::own_network_namespace!();

const USAGE: &str = "usage: kvgate-dev-cluster [--nodes N] [--out DIR] [--forward NAMESPACE/SERVICE]...

Starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler in a network namespace of
their own and N nodes (default 2, at most 32: node-1, node-2, ...), each a node agent in a network
namespace of its own with its own pod bridge and pod CIDR (198.18.I.0/24), all joined by a fabric
(198.19.0.0/24) through the control plane's namespace. The nodes pull images from a registry there (198.19.0.1:5000, also
their mirror of ghcr.io), which holds kvgate's images built from target/debug. Relays the API server to 127.0.0.1
(kubeconfig: DIR/kubeconfig, written once all is up), the registry (its address in DIR/registry, the nodes' in
DIR/registry-for-nodes; push with scripts/push.sh ADDRESS/kvgate --insecure) and each --forward Service to a free port
on 127.0.0.1 (written to DIR/forward/NAMESPACE.SERVICE).
DIR is target/dev-cluster unless --out says otherwise.";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return Ok(());
    }
    let value = |flag: &str| args.windows(2).filter(|w| w[0] == flag).map(|w| w[1].clone()).collect::<Vec<_>>();
    let forwards = value("--forward");
    let nodes: u8 = match value("--nodes").pop() {
        Some(n) => n
            .parse()
            .ok()
            .filter(|n| (1..=kvgate_testenv::fabric::MAX_NODES).contains(n))
            .ok_or_else(|| anyhow::anyhow!("--nodes {n}: expected a number of nodes from 1 to {}", kvgate_testenv::fabric::MAX_NODES))?,
        None => 2,
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let worker = root.join("target/debug/kvgate-worker");
    let operator = root.join("target/debug/kvgate-operator");
    for bin in [&worker, &operator] {
        if !bin.is_file() {
            anyhow::bail!("{} not found: run `cargo build -p kvgate-worker -p kvgate-operator` first", bin.display());
        }
    }
    let agent = std::env::current_exe()?.with_file_name("kvgate-node-agent");
    let cp = tokio::task::spawn_blocking(ControlPlane::start).await??;
    // The images the chart and the operator name: OCI images of these binaries, pushed to the
    // world's registry (which nodes pull ghcr.io's images from) and run by runc.
    let images = tokio::task::spawn_blocking(kvgate_testenv::images::node_images).await??;
    let mut started = Vec::new();
    for i in 1..=nodes {
        started.push(cp.node_agent(&agent, &format!("node-{i}"), &images)?);
    }

    let out = value("--out").pop().map(std::path::PathBuf::from).unwrap_or_else(|| root.join("target/dev-cluster"));
    std::fs::create_dir_all(out.join("forward"))?;
    let api: SocketAddr = cp.server.trim_start_matches("https://").parse()?;
    let api_relay = Relay::start(0, Arc::new(move || Ok(api)))?;
    // The registry from the host too: `make push REGISTRY=127.0.0.1:PORT/kvgate INSECURE=1`.
    let registry: SocketAddr = kvgate_testenv::registry::local().parse()?;
    let registry_relay = Relay::start(0, Arc::new(move || Ok(registry)))?;
    std::fs::write(out.join("registry"), registry_relay.addr.to_string())?;
    std::fs::write(out.join("registry-for-nodes"), kvgate_testenv::registry::host())?;
    let client = cp.client().await?;
    for spec in &forwards {
        let (ns, svc) = spec.split_once('/').ok_or_else(|| anyhow::anyhow!("--forward {spec}: expected NAMESPACE/SERVICE"))?;
        let relay = Relay::start(0, service_target(client.clone(), ns, svc))?;
        std::fs::write(out.join("forward").join(format!("{ns}.{svc}")), relay.addr.port().to_string())?;
        println!("  service {spec}: http://{}", relay.addr);
    }
    // Written last: its presence tells scripts that everything above is up.
    let kubeconfig = out.join("kubeconfig");
    let text = std::fs::read_to_string(&cp.kubeconfig)?.replace(&cp.server, &format!("https://{}", api_relay.addr));
    std::fs::write(&kubeconfig, text)?;
    println!(
        "kvgate dev cluster is up: API server https://{}, nodes {}, registry {} (nodes pull it as {}, and ghcr.io/kvgate/kvgate-worker and -operator from it: built from target/debug, run by runc)",
        api_relay.addr,
        started.iter().map(|n| n.name.as_str()).collect::<Vec<_>>().join(", "),
        registry_relay.addr,
        kvgate_testenv::registry::host(),
    );
    println!("  export KUBECONFIG={}", kubeconfig.canonicalize()?.display());
    println!("  kubectl get nodes");
    println!("Component logs are in {}. Press Ctrl-C to stop.", cp.dir.display());
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = term.recv() => {}
    }
    let _ = std::fs::remove_file(&kubeconfig);
    let _ = std::fs::remove_dir_all(out.join("forward"));
    let _ = std::fs::remove_file(out.join("registry"));
    let _ = std::fs::remove_file(out.join("registry-for-nodes"));
    drop(started);
    drop(cp);
    println!("stopped");
    Ok(())
}

/// Each connection goes to a ready endpoint of the Service, as kube-proxy would send it.
fn service_target(client: kube::Client, ns: &str, svc: &str) -> Target {
    let slices: Api<EndpointSlice> = Api::namespaced(client, ns);
    let selector = format!("kubernetes.io/service-name={svc}");
    let handle = tokio::runtime::Handle::current();
    let what = format!("service {ns}/{svc}");
    Arc::new(move || {
        let list = handle.block_on(slices.list(&ListParams::default().labels(&selector))).map_err(io::Error::other)?;
        list.items
            .iter()
            .find_map(|s| {
                let port = s.ports.as_ref()?.first()?.port?;
                let ready = s.endpoints.iter().flatten().find(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))?;
                Some(SocketAddr::new(ready.addresses.first()?.parse().ok()?, port as u16))
            })
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, format!("{what} has no ready endpoint")))
    })
}
