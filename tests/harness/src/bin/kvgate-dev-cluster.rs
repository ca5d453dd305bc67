//! `make dev-cluster`: the test control plane and a node agent in the foreground, for people.
//! Writes `target/dev-cluster/kubeconfig` and stops everything on Ctrl-C.

use std::path::Path;

use kvgate_testenv::ControlPlane;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let worker = root.join("target/debug/kvgate-worker");
    if !worker.is_file() {
        anyhow::bail!("{} not found: run `cargo build -p kvgate-worker` first", worker.display());
    }
    let agent = std::env::current_exe()?.with_file_name("kvgate-node-agent");
    let cp = tokio::task::spawn_blocking(ControlPlane::start).await??;
    let node = cp.node_agent(&agent, "dev-node", &[("kvgate/worker", &worker)])?;
    let out = root.join("target/dev-cluster");
    std::fs::create_dir_all(&out)?;
    let kubeconfig = out.join("kubeconfig");
    std::fs::copy(&cp.kubeconfig, &kubeconfig)?;
    println!("kvgate dev cluster is up: API server {}, node dev-node (image kvgate/worker -> {})", cp.server, worker.display());
    println!("  export KUBECONFIG={}", kubeconfig.canonicalize()?.display());
    println!("  kubectl get nodes");
    println!("Component logs are in {}. Press Ctrl-C to stop.", cp.dir.display());
    tokio::signal::ctrl_c().await?;
    drop(node);
    drop(cp);
    println!("stopped");
    Ok(())
}
