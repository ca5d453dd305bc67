//! Command-line interface of `kvgate-worker`.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use kvgate_proto::contract::{self, flag};

use crate::kv::{KvDtype, PoolSize};
use crate::model::ModelSource;

#[derive(Debug, Parser)]
#[command(name = "kvgate-worker", version, about = "kvgate's inference worker: a Llama-architecture model over a measured, paged KV pool")]
pub struct Cli {
    /// Check the arguments as the command would on start, print what is wrong, and exit
    /// without starting (0 when they are valid).
    #[arg(long, global = true)]
    pub check_config: bool,
    /// Log lines as `text` (coloured only on a terminal) or `json` (one object per line).
    #[arg(long = flag::LOG_FORMAT, global = true, value_enum, default_value_t, env = kvgate_telemetry::LOG_FORMAT_ENV)]
    pub log_format: kvgate_telemetry::LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the OpenAI-compatible API on one machine: router, prefill and decode roles in one
    /// process, each on its own loopback listener, talking over real sockets (or, with
    /// --colocated, one engine that prefills and decodes itself).
    Local(LocalArgs),
    /// The front door: admits requests, pairs a prefill and a decode peer, streams tokens back.
    Router(RouterArgs),
    /// Computes prompts' KV and streams it into decode's reservations.
    Prefill(PrefillArgs),
    /// Reserves KV pages, verifies every handoff, and generates from verified ones only.
    Decode(DecodeArgs),
    /// Allocate the KV pool exactly as serving would, print the capacity report, and exit
    /// non-zero when it cannot hold --context-window tokens (a preflight or init container).
    Probe(ProbeArgs),
}

impl Command {
    /// The `service.name` of this process's spans (unless `OTEL_SERVICE_NAME` names another).
    /// Whether the command loads a model and runs its steps (the router only forwards).
    pub fn runs_a_model(&self) -> bool {
        !matches!(self, Command::Router(_))
    }

    pub fn service_name(&self) -> &'static str {
        match self {
            Command::Local(_) => "kvgate-local",
            Command::Router(_) => "kvgate-router",
            Command::Prefill(_) => "kvgate-prefill",
            Command::Decode(_) => "kvgate-decode",
            Command::Probe(_) => "kvgate-probe",
        }
    }
}

#[derive(Debug, Args)]
pub struct LocalArgs {
    /// Address of the HTTP API (the router's; prefill and decode take free loopback ports).
    #[arg(long = flag::LISTEN, default_value = "127.0.0.1:8080", env = "KVGATE_LISTEN")]
    pub listen: SocketAddr,
    /// One engine prefills and decodes itself: no handoff.
    #[arg(long)]
    pub colocated: bool,
    #[command(flatten)]
    pub serve: ServeArgs,
    #[command(flatten)]
    pub tenants: TenantArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub scheduler: SchedulerArgs,
    #[command(flatten)]
    pub handoff: HandoffArgs,
}

#[derive(Debug, Args)]
pub struct RouterArgs {
    /// Address of the HTTP API (OpenAI-compatible, /metrics, /healthz, /readyz).
    #[arg(long = flag::LISTEN, default_value = "0.0.0.0:8080", env = "KVGATE_LISTEN")]
    pub listen: SocketAddr,
    /// Prefill peers' HTTP addresses (`host:port`), space-separated or repeated.
    #[arg(long, num_args = 1.., required_unless_present = "prefill_service", conflicts_with = "prefill_service")]
    pub prefill: Vec<String>,
    /// Decode peers' HTTP addresses (`host:port`), space-separated or repeated.
    #[arg(long, num_args = 1.., required_unless_present = "decode_service", conflicts_with = "decode_service")]
    pub decode: Vec<String>,
    /// In a cluster: find prefill peers as the ready endpoints (port `http`) of this Service's
    /// EndpointSlices (needs get/list on endpointslices; kubeconfig from $KUBECONFIG or in-cluster).
    #[arg(long = flag::PREFILL_SERVICE, requires = "decode_service")]
    pub prefill_service: Option<String>,
    /// In a cluster: find decode peers likewise.
    #[arg(long = flag::DECODE_SERVICE, requires = "prefill_service")]
    pub decode_service: Option<String>,
    /// Namespace of those Services.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// `tiny`, a checkpoint directory or a `.gguf` file: the router needs only its name and
    /// tokenizer.
    #[arg(long = flag::MODEL, default_value = "tiny", env = "KVGATE_MODEL")]
    pub model: ModelSource,
    /// Declared context window: prompt + completion tokens one request may use.
    #[arg(long = flag::CONTEXT_WINDOW, default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..))]
    pub context_window: u64,
    #[command(flatten)]
    pub serve: ServeArgs,
    #[command(flatten)]
    pub tenants: TenantArgs,
    #[command(flatten)]
    pub secret: SecretArgs,
}

#[derive(Debug, Args)]
pub struct PrefillArgs {
    /// Address of prefill's HTTP API (its internal calls, /v1/kv-pool, /metrics, probes).
    #[arg(long = flag::LISTEN, default_value = "0.0.0.0:8081", env = "KVGATE_LISTEN")]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub serve: ServeArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub scheduler: SchedulerArgs,
    #[command(flatten)]
    pub secret: SecretArgs,
    /// At start, prefill a prompt of this many tokens and one of half as many, and report the
    /// timings (the operator compares the declared window's estimated prefill time with the
    /// handoff timeout); at most the window and the pool. 0 skips it.
    #[arg(long, default_value_t = 1024)]
    pub prefill_probe_tokens: u64,
}

#[derive(Debug, Args)]
pub struct DecodeArgs {
    /// Address of decode's HTTP API (its internal calls, /v1/kv-pool, /metrics, probes).
    #[arg(long = flag::LISTEN, default_value = "0.0.0.0:8082", env = "KVGATE_LISTEN")]
    pub listen: SocketAddr,
    /// Address of the KV port prefill peers stream pages to.
    #[arg(long = flag::KV_LISTEN, default_value = "0.0.0.0:8083", env = "KVGATE_KV_LISTEN")]
    pub kv_listen: SocketAddr,
    /// Address prefill peers should dial for the KV port, when it differs from --kv-listen
    /// (e.g. the pod IP when listening on 0.0.0.0).
    #[arg(long = flag::KV_ADVERTISE, env = "KVGATE_KV_ADVERTISE")]
    pub kv_advertise: Option<String>,
    #[command(flatten)]
    pub serve: ServeArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub scheduler: SchedulerArgs,
    #[command(flatten)]
    pub handoff: HandoffArgs,
}

/// What a listener and the public API grant any one peer: every port is reachable by whoever is
/// on the pod network, so none of them may let one client stall the others.
#[derive(Debug, Args, Clone)]
pub struct ServeArgs {
    /// Most HTTP connections open at once; more are closed when accepted (counted in
    /// `kvgate_connections_refused_total`).
    #[arg(long, env = "KVGATE_MAX_CONNECTIONS", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: u64,
    /// Most HTTP connections one client address may hold at once.
    #[arg(long, env = "KVGATE_MAX_CONNECTIONS_PER_CLIENT", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections_per_client: u64,
    /// Longest an HTTP connection may wait for, or take to send, a request head (idle
    /// keep-alives and slow headers are closed after it). A request body must then arrive
    /// within 5 s plus a second per 8 MiB (408 otherwise). Keep it above 2 s on prefill and
    /// decode: routers reuse an idle connection to a peer for up to 2 s.
    #[arg(long, env = "KVGATE_IDLE_TIMEOUT_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_timeout_ms: u64,
    /// Most requests one tenant (see --api-keys; its address where nobody is authenticated)
    /// may have in flight on the public API; more are answered 429.
    #[arg(long, env = "KVGATE_MAX_REQUESTS_PER_CLIENT", default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_requests_per_client: u64,
    /// After SIGTERM: report not ready and keep accepting this long, so that a Service's
    /// endpoints and the routers' peers drop this process before it stops listening; then stop
    /// accepting and finish the requests in flight. 0: stop accepting at once. Set on pods by the
    /// operator (3000, within their 10 s termination grace).
    #[arg(long, env = "KVGATE_SHUTDOWN_DELAY_MS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub shutdown_delay_ms: u64,
}

/// Who may call the public API, and how much each tenant may use it. With neither --api-keys
/// nor --trusted-proxy-header nobody is authenticated and each client address is a tenant
/// (for a deployment that a gateway or NetworkPolicy already closes).
#[derive(Debug, Args, Clone, Default)]
pub struct TenantArgs {
    /// Directory of API keys, as a Kubernetes Secret is mounted: one file per tenant, named for
    /// the tenant, holding its keys one per line (at least 16 characters each). Requests without
    /// a known `Authorization: Bearer` key get 401. Only hashes are kept; the directory is read
    /// again every 2 s, so keys change without a restart.
    #[arg(long = flag::API_KEYS, env = "KVGATE_API_KEYS")]
    pub api_keys: Option<PathBuf>,
    /// A gateway in front authenticates clients and names the tenant in this header, believed
    /// only from --trusted-proxy-cidr addresses. Without --api-keys, requests from anywhere else
    /// get 401; with it, they authenticate with a key.
    #[arg(long = flag::TRUSTED_PROXY_HEADER, env = "KVGATE_TRUSTED_PROXY_HEADER", requires = "trusted_proxy_cidr")]
    pub trusted_proxy_header: Option<String>,
    /// The gateway's source addresses (CIDR), space-separated or repeated.
    #[arg(long = flag::TRUSTED_PROXY_CIDR, num_args = 1.., requires = "trusted_proxy_header")]
    pub trusted_proxy_cidr: Vec<String>,
    /// Prompt + generated tokens per minute each tenant may use (0: no quota). A request whose
    /// prompt its tenant's bucket cannot hold now is answered 429 naming the quota.
    #[arg(long = flag::TENANT_TOKENS_PER_MINUTE, env = "KVGATE_TENANT_TOKENS_PER_MINUTE", default_value_t = 0)]
    pub tenant_tokens_per_minute: u64,
    /// One tenant's own quota, `NAME=TOKENS_PER_MINUTE` (0: none), space-separated or repeated.
    #[arg(long = flag::TENANT_QUOTA, num_args = 1..)]
    pub tenant_quota: Vec<String>,
}

#[derive(Debug, Args, Clone)]
pub struct SchedulerArgs {
    /// Most prompt + decode tokens in one batched forward pass (prompts are prefilled in chunks).
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_batch_tokens: u32,
    /// How long a request waits for free KV pages before it is answered 503.
    #[arg(long, default_value_t = 30_000)]
    pub admission_timeout_ms: u64,
    /// While sequences are decoding, a step that also carries a prompt chunk may take at most
    /// this many decode-only steps: chunks are sized from measured step costs, so one long
    /// prompt does not stall every stream. 0 turns this off (a chunk takes --max-batch-tokens).
    #[arg(long, default_value_t = 2.0, value_parser = stall_limit)]
    pub decode_stall_limit: f64,
    /// While more than one tenant has had work in the last 2 s, a prompt chunk takes about this
    /// long at most, so one tenant's long prompts cannot make another's request wait for a
    /// whole chunk (a tenant alone gets whole chunks). 0 turns this off.
    #[arg(long, default_value_t = 10)]
    pub shared_chunk_ms: u64,
}

fn stall_limit(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x == 0.0 || (x >= 1.0 && x.is_finite()) => Ok(x),
        _ => Err(format!("`{s}` is not 0 (off) or a number of decode-only steps of at least 1")),
    }
}

impl SchedulerArgs {
    pub fn config(&self) -> crate::engine::SchedulerConfig {
        crate::engine::SchedulerConfig {
            max_batch_tokens: self.max_batch_tokens as usize,
            admission_timeout: std::time::Duration::from_millis(self.admission_timeout_ms),
            stall_limit: if self.decode_stall_limit > 0.0 { self.decode_stall_limit } else { f64::INFINITY },
            shared_step: (self.shared_chunk_ms > 0).then(|| std::time::Duration::from_millis(self.shared_chunk_ms)),
        }
    }
}

#[derive(Debug, Args, Clone)]
pub struct SecretArgs {
    /// File holding the secret shared by the deployment's pods (at least 16 bytes). Every call
    /// between roles is signed with a key derived from it, reservations are tagged and KV frames
    /// MACed with it. Required by `router`, `prefill` and `decode`; `local` makes a random one.
    #[arg(long = flag::HANDOFF_SECRET_FILE, env = "KVGATE_HANDOFF_SECRET_FILE")]
    pub handoff_secret_file: Option<PathBuf>,
}

#[derive(Debug, Args, Clone)]
pub struct HandoffArgs {
    #[command(flatten)]
    pub secret: SecretArgs,
    /// How long a reservation waits for its commit before its pages are freed.
    #[arg(long = flag::HANDOFF_TIMEOUT_MS, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub handoff_timeout_ms: u64,
    /// Most reservations decode holds open (or committed and not yet decoding) at once; more
    /// are answered 503.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_open_reservations: u64,
    /// Most authenticated connections decode's KV port serves at once (each carries a
    /// reservation's pages); more are closed.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_max_connections: u64,
    /// Most KV connections that have not yet sent an authentic frame, in all and per client
    /// address: strangers get these, never the slots of peers that hold the secret.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_max_unauthenticated: u64,
    /// Of --kv-max-unauthenticated, how many one client address may hold: a flood from one
    /// address cannot take every stranger's place.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_max_unauthenticated_per_client: u64,
    /// Longest a new KV connection may take to deliver its first authentic frame.
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_auth_timeout_ms: u64,
    /// Longest one frame may take to arrive on the KV port (and longest a connection may idle
    /// between frames) before the connection is closed.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_frame_timeout_ms: u64,
}

#[derive(Debug, Args)]
pub struct ProbeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Print the report as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Model, window and KV pool settings shared by every command.
#[derive(Debug, Args, Clone)]
pub struct EngineArgs {
    /// `tiny` (built-in, seeded weights), a checkpoint directory with config.json,
    /// *.safetensors and tokenizer.json, or a `.gguf` file (llama.cpp's format: Llama, Mistral
    /// or Qwen2 in f32, f16, Q8_0, Q4_K, Q6_K ..., served on the CPU in its own types).
    #[arg(long = flag::MODEL, default_value = "tiny", env = "KVGATE_MODEL")]
    pub model: ModelSource,
    /// Declared context window: prompt + completion tokens one request may use.
    #[arg(long = flag::CONTEXT_WINDOW, default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..))]
    pub context_window: u64,
    /// The pod this worker runs in (the operator sets POD_NAME from the downward API). Its
    /// signed capacity reports name it, so one pod's report never verifies another pod.
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    #[command(flatten)]
    pub pool: PoolArgs,
}

#[derive(Debug, Args, Clone)]
#[group(skip)]
pub struct PoolArgs {
    /// KV pool size in bytes (rounded down to whole pages).
    #[arg(long = flag::KV_POOL_BYTES, conflicts_with_all = ["kv_pool_tokens", "kv_memory_fraction"], value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_pool_bytes: Option<u64>,
    /// KV pool size in tokens (rounded up to whole pages).
    #[arg(long = flag::KV_POOL_TOKENS, conflicts_with = "kv_memory_fraction", value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_pool_tokens: Option<u64>,
    /// KV pool size as a fraction (0, 1] of the memory this process may use after loading the
    /// model (respects the cgroup limit). Without any size flag the pool holds four times the
    /// context window.
    #[arg(long = flag::KV_MEMORY_FRACTION, value_parser = parse_fraction)]
    pub kv_memory_fraction: Option<f64>,
    /// Tokens per KV page (a power of two).
    #[arg(long = flag::PAGE_SIZE, default_value_t = 16, value_parser = parse_page_size)]
    pub page_size: usize,
    /// Element type of stored K/V: f32, f16, bf16, or q8_0 (blocks of 32 values with an f16
    /// scale, 8.5 bits a value, as llama.cpp's `-ctk q8_0`; the model's kv heads x head dim must
    /// be a multiple of 32).
    #[arg(long = flag::KV_DTYPE, default_value = "f32")]
    pub kv_dtype: KvDtype,
    /// Where the pool lives: `cpu`, or `cuda` / `cuda:N` (needs the `cuda` build feature).
    #[arg(long = flag::DEVICE, default_value = "cpu", value_parser = parse_device)]
    pub device: String,
    /// Skip zeroing freed pages (they stay unreadable through the generation check either way).
    #[arg(long)]
    pub no_kv_scrub: bool,
    /// Where to write the capacity report after allocation (for an init container).
    #[arg(long)]
    pub report_file: Option<PathBuf>,
}

impl PoolArgs {
    /// The requested size; four times the window when none is given.
    pub fn size(&self, context_window: u64) -> PoolSize {
        match (self.kv_pool_bytes, self.kv_pool_tokens, self.kv_memory_fraction) {
            (Some(b), _, _) => PoolSize::Bytes(b),
            (_, Some(t), _) => PoolSize::Tokens(t),
            (_, _, Some(f)) => PoolSize::MemoryFraction(f),
            _ => PoolSize::Tokens(context_window.saturating_mul(4)),
        }
    }
}

// Value parsers return `String` errors: that is clap's `value_parser` interface.
fn parse_page_size(s: &str) -> Result<usize, String> {
    let n: u64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if !contract::page_size_supported(n) {
        return Err(format!("--page-size must be a power of two between 1 and {}, got {n}", contract::PAGE_SIZES[contract::PAGE_SIZES.len() - 1]));
    }
    Ok(n as usize)
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    let f: f64 = s.parse().map_err(|_| format!("`{s}` is not a decimal number"))?;
    if !(f > 0.0 && f <= 1.0) {
        return Err(format!("--kv-memory-fraction must be in (0, 1], got {s}"));
    }
    Ok(f)
}

fn parse_device(s: &str) -> Result<String, String> {
    let ok = s == "cpu" || s == "cuda" || s.strip_prefix("cuda:").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    if !ok {
        return Err(format!("--device must be cpu, cuda or cuda:N, got `{s}`"));
    }
    Ok(s.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cli_is_well_formed() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn pool_flags_are_exclusive_and_default_to_four_windows() {
        let cli = Cli::try_parse_from(["kvgate-worker", "local"]).unwrap();
        let Command::Local(a) = cli.command else { panic!() };
        assert_eq!(a.engine.pool.size(a.engine.context_window), PoolSize::Tokens(4 * 8192));
        let err = Cli::try_parse_from(["kvgate-worker", "local", "--kv-pool-bytes", "1", "--kv-pool-tokens", "2"]).unwrap_err();
        assert!(err.to_string().contains("cannot be used with"), "{err}");
        let err = Cli::try_parse_from(["kvgate-worker", "local", "--page-size", "12"]).unwrap_err();
        assert!(err.to_string().contains("power of two"), "{err}");
    }

    #[test]
    fn the_decode_stall_limit_is_off_or_at_least_one_step() {
        let config = |extra: &[&str]| {
            let cli = Cli::try_parse_from(["kvgate-worker", "local"].iter().chain(extra)).map_err(|e| e.to_string())?;
            let Command::Local(a) = cli.command else { panic!() };
            Ok::<_, String>(a.scheduler.config().stall_limit)
        };
        assert_eq!(config(&[]), Ok(2.0));
        assert_eq!(config(&["--decode-stall-limit", "0"]), Ok(f64::INFINITY));
        for bad in ["0.5", "-1", "NaN", "inf"] {
            let err = config(&[&format!("--decode-stall-limit={bad}")]).unwrap_err();
            assert!(err.contains("--decode-stall-limit") && err.contains("at least 1"), "{err}");
        }
    }
}
