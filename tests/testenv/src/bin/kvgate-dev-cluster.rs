//! `make dev-cluster`: the test control plane and a node agent in the foreground, for people.
//! Writes `target/dev-cluster/kubeconfig` and stops everything on Ctrl-C.

use std::path::Path;

use kvgate_testenv::ControlPlane;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
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
    // The images the chart and the operator name run as these local binaries.
    let images = [("ghcr.io/kvgate/kvgate-worker", worker.as_path()), ("ghcr.io/kvgate/kvgate-operator", operator.as_path())];
    let node = cp.node_agent(&agent, "dev-node", &images)?;
    let out = root.join("target/dev-cluster");
    std::fs::create_dir_all(&out)?;
    let kubeconfig = out.join("kubeconfig");
    std::fs::copy(&cp.kubeconfig, &kubeconfig)?;
    println!("kvgate dev cluster is up: API server {}, node dev-node (images ghcr.io/kvgate/kvgate-worker and -operator run from target/debug)", cp.server);
    println!("  export KUBECONFIG={}", kubeconfig.canonicalize()?.display());
    println!("  kubectl get nodes");
    println!("Component logs are in {}. Press Ctrl-C to stop.", cp.dir.display());
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = term.recv() => {}
    }
    drop(node);
    drop(cp);
    println!("stopped");
    Ok(())
}
