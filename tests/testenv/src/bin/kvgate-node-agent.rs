//! `kvgate-node-agent --kubeconfig K --server URL --ca-file CA --kubelet-cert C --kubelet-key K --node-ip IP --pod-cidr CIDR --image NAME=oci:LAYOUT:TAG ...`
//! Plays the kubelet's part: see `kvgate_testenv::node`.

use std::path::PathBuf;

use kvgate_testenv::node::{AgentConfig, ImageTable, NodeAgent};

/// `--flag value` or `--flag=value`.
fn arg(args: &[String], flag: &str) -> Option<String> {
    let prefix = format!("{flag}=");
    args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1).cloned()).or_else(|| args.iter().find_map(|a| a.strip_prefix(&prefix).map(str::to_string)))
}

fn main() -> anyhow::Result<()> {
    // Before any thread: the writable roots' overlays are mounted in a namespace of the agent's
    // own, never in the host's, and go with it (node::rootfs).
    let private = kvgate_testenv::node::rootfs::private_mounts();
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run(private))
}

async fn run(private: Result<(), String>) -> anyhow::Result<()> {
    let _traces = kvgate_telemetry::init(kvgate_telemetry::LogFormat::Text, "info", "kvgate-node-agent");
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!(
            "usage: kvgate-node-agent --kubeconfig PATH --server URL --ca-file PATH --kubelet-cert PATH --kubelet-key PATH --node-ip IP --pod-cidr CIDR\n\
             \x20      [--cpu N] [--memory QUANTITY] [--ephemeral-storage QUANTITY] [--heartbeat-seconds N] [--cni-bin DIR] [--node-name NAME] [--dir DIR] [--image NAME=oci:LAYOUT:TAG | NAME=PATH]...\n\
             \x20      [--insecure-registry HOST:PORT]... [--registry-mirror REGISTRY=MIRROR]...\n\n\
             Runs the pods kube-scheduler binds to this node (it binds none itself). Run it in the node's own network namespace\n\
             (kvgate_testenv::fabric): --node-ip is the node's address there (its InternalIP), --pod-cidr the range its pods get\n\
             addresses from (behind a bridge holding the range's first address). --cpu, --memory and --ephemeral-storage are the\n\
             node's allocatable resources (default 16, 64Gi and 100Gi); --heartbeat-seconds how often its Lease is renewed (default 10, as a kubelet's).\n\
             --server is the API server as pods reach it; --cni-bin holds the CNI plugins bridge, host-local and loopback (default target/cni/bin, from `make tools`).\n\
             --image maps an image name (matched with or without its tag) to an OCI image layout and tag (`make images`, scripts/images.sh), run as\n\
             OCI containers by runc (unpacked under DIR/images, state under DIR/runc), or to a host binary run as a process in the pod's namespaces.\n\
             Any other image is pulled by reference from the registry it names (skopeo, into DIR/pulled), as a kubelet's runtime pulls\n\
             by the container's imagePullPolicy (Always: at every start; IfNotPresent: once per node; Never: never):\n\
             a failed pull leaves the container ErrImagePull, then ImagePullBackOff until the next try. --insecure-registry names a registry\n\
             reached over plain HTTP (as containerd's hosts.toml allows); every other registry needs TLS.\n\
             --registry-mirror pulls REGISTRY's images from MIRROR, repository paths unchanged (ghcr.io=198.19.0.1:5000).\n\
             --kubelet-cert/--kubelet-key serve the kubelet API (containerLogs for `kubectl logs`, portForward for `kubectl port-forward`)\n\
             on a port advertised in the Node's status;\n\
             only the API server's client certificate (CN kube-apiserver-kubelet-client, signed by --ca-file) is accepted there.\n\
             A container whose root is writable gets an overlay of its image (its writes in its bundle), mounted in a mount namespace\n\
             of the agent's own; without one (not root) the root is a copy of the image. Pods' /etc/resolv.conf names the node's\n\
             bridge address, where the agent answers SERVICE.NAMESPACE.svc[.cluster.local] (A records) on port 53."
        );
        return Ok(());
    }
    let need = |flag: &str| arg(&args, flag).ok_or_else(|| anyhow::anyhow!("{flag} is required (see --help)"));
    let repeated = |flag: &str| -> Vec<String> { args.windows(2).filter(|w| w[0] == flag).map(|w| w[1].clone()).collect() };
    let images = repeated("--image");
    let kubeconfig = PathBuf::from(need("--kubeconfig")?);
    let kc = kube::config::Kubeconfig::read_from(&kubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    let client = kube::Client::try_from(config)?;
    let node_name = arg(&args, "--node-name").unwrap_or_else(|| "kvgate-node".into());
    let dir = PathBuf::from(arg(&args, "--dir").unwrap_or_else(|| std::env::temp_dir().join(format!("kvgate-node-{node_name}")).display().to_string()));
    std::fs::create_dir_all(&dir)?;
    let cni_bin = arg(&args, "--cni-bin").map(PathBuf::from).unwrap_or_else(kvgate_testenv::node::network::default_bin_dir);
    let default = kvgate_testenv::nodes::Resources::default();
    let cfg = AgentConfig {
        node_name,
        images: ImageTable::parse(&images)?,
        insecure_registries: repeated("--insecure-registry"),
        registry_mirrors: repeated("--registry-mirror"),
        dir,
        server: need("--server")?,
        ca_file: PathBuf::from(need("--ca-file")?),
        cni_bin,
        kubelet_cert: PathBuf::from(need("--kubelet-cert")?),
        kubelet_key: PathBuf::from(need("--kubelet-key")?),
        node_ip: need("--node-ip")?.parse().map_err(|e| anyhow::anyhow!("--node-ip: {e}"))?,
        pod_cidr: need("--pod-cidr")?,
        cpu: arg(&args, "--cpu").unwrap_or(default.cpu),
        memory: arg(&args, "--memory").unwrap_or(default.memory),
        ephemeral_storage: arg(&args, "--ephemeral-storage").unwrap_or(default.ephemeral_storage),
        heartbeat: std::time::Duration::from_secs(arg(&args, "--heartbeat-seconds").map(|s| s.parse()).transpose()?.unwrap_or(10)),
    };
    if let Err(e) = private {
        tracing::warn!(error = e, "no mount namespace of its own: a writable container root is a copy of its image");
    }
    println!("kvgate-node-agent: node {} ready", cfg.node_name);
    let agent = NodeAgent::new(client, cfg)?;
    // On SIGTERM or Ctrl-C the agent is dropped, which tears every pod down (processes,
    // network namespace and address, cgroup); the pods' processes share its process group.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = agent.run() => r,
        _ = term.recv() => Ok(()),
        _ = tokio::signal::ctrl_c() => Ok(()),
    }
}
