//! Command-line interface of `kvgate-operator`.

use std::net::SocketAddr;

use clap::{Args, Parser, Subcommand};

/// The root key Secret's default name.
pub const DEFAULT_ROOT_KEY_SECRET: &str = "kvgate-operator-root-key";

/// The worker image of this operator's own version.
pub const DEFAULT_WORKER_IMAGE: &str = concat!("ghcr.io/kvgate/kvgate-worker:", env!("CARGO_PKG_VERSION"));

#[derive(Debug, Parser)]
#[command(
    name = "kvgate-operator",
    version,
    about = "kvgate's operator: deploys disaggregated prefill/decode workers and refuses rollouts whose measured KV pool is below the declared context window"
)]
pub struct Cli {
    /// Log lines as `text` (coloured only on a terminal) or `json` (one object per line; the
    /// chart's default).
    #[arg(long, global = true, value_enum, default_value_t, env = kvgate_telemetry::LOG_FORMAT_ENV)]
    pub log_format: kvgate_telemetry::LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
// Parsed once at start-up: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Run the controller (kubeconfig from $KUBECONFIG or ~/.kube/config, else in-cluster).
    Run(RunArgs),
    /// Print the CustomResourceDefinitions as YAML (what `crds/` holds).
    Crd,
    /// Ask every ready endpoint of a Service for a path over HTTP; exit 0 only if there is one
    /// and all answer 200 (the chart's `helm test`: the image has no shell and no curl).
    Check {
        /// The Service (its EndpointSlices are read with the pod's ServiceAccount).
        #[arg(long)]
        service: String,
        /// Its namespace.
        #[arg(long, env = "POD_NAMESPACE")]
        namespace: String,
        /// The endpoint port's name.
        #[arg(long, default_value = "metrics")]
        port_name: String,
        /// The path to GET.
        #[arg(long, default_value = "/readyz")]
        path: String,
        /// Seconds to wait for each answer.
        #[arg(long, default_value_t = 10)]
        timeout: u64,
    },
}

#[derive(Debug, Args, Clone)]
pub struct RunArgs {
    /// Kubeconfig to use (default: $KUBECONFIG, ~/.kube/config, else the in-cluster config).
    #[arg(long)]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:8080", env = "KVGATE_METRICS_ADDR")]
    pub metrics_addr: SocketAddr,
    /// Watch one namespace only (default: all namespaces).
    #[arg(long, env = "KVGATE_WATCH_NAMESPACE")]
    pub namespace: Option<String>,
    /// Worker image for deployments that name none.
    #[arg(long, default_value = DEFAULT_WORKER_IMAGE, env = "KVGATE_WORKER_IMAGE")]
    pub worker_image: String,
    /// Log lines of the worker pods this operator renders (`--log-format` of router, prefill and
    /// decode): pods' logs are read by `kubectl logs` and log pipelines, not terminals.
    #[arg(long, value_enum, default_value = "json", env = "KVGATE_WORKER_LOG_FORMAT")]
    pub worker_log_format: kvgate_telemetry::LogFormat,
    /// OTLP/HTTP endpoint the worker pods export their spans to (`http://collector:4318`; the
    /// standard OTEL_EXPORTER_OTLP_ENDPOINT of each pod). Unset: pods export nothing. The
    /// operator's own spans follow its own OTEL_* variables.
    #[arg(long, env = "KVGATE_WORKER_OTLP_ENDPOINT")]
    pub worker_otlp_endpoint: Option<String>,
    /// Take a Lease before reconciling, so that of several replicas only one writes.
    #[arg(long)]
    pub leader_elect: bool,
    /// With --leader-elect: a standby watches nothing until it takes the Lease (less memory, a
    /// failover that lists every kind first). By default a standby keeps its watches and stores
    /// current and holds back only its writes.
    #[arg(long, requires = "leader_elect")]
    pub cold_standby: bool,
    /// Name of the leader-election Lease.
    #[arg(long, default_value = "kvgate-operator")]
    pub lease_name: String,
    /// The operator's own namespace, where its leader-election Lease and its root key Secret
    /// live (default: this pod's namespace, else `default`).
    #[arg(long = "operator-namespace", alias = "lease-namespace", env = "POD_NAMESPACE")]
    pub lease_namespace: Option<String>,
    /// The Secret (in the operator's namespace) holding the root key every deployment's handoff
    /// secret is derived from; created on first start. The operator reads no other Secret.
    #[arg(long, default_value = DEFAULT_ROOT_KEY_SECRET)]
    pub root_key_secret: String,
    /// InferenceDeployments reconciled at once (a pass never waits on a pod: probes, scrapes and
    /// canaries run in the background).
    #[arg(long, default_value_t = 16)]
    pub concurrency: u16,
    /// This replica's identity in the Lease (default: hostname or pod name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Node directories (comma-separated prefixes) that a hostPath volume may name:
    /// `spec.model.volume.hostPath` and any role's `volumes`. Empty (the default): every hostPath
    /// is refused, since whoever may create an InferenceDeployment would otherwise have the
    /// operator mount any node directory.
    #[arg(long, env = "KVGATE_ALLOWED_HOST_PATHS", value_delimiter = ',')]
    pub allowed_host_paths: Vec<String>,
}
