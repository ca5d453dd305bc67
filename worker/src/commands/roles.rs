//! Starting each role: its engine, listeners and HTTP app. `local` starts all three here too.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;

use axum::extract::DefaultBodyLimit;

use crate::cli::{DecodeArgs, EngineArgs, LocalArgs, PrefillArgs, RouterArgs, SchedulerArgs, SecretArgs, ServeArgs};
use crate::engine::Engine;
use crate::handoff::reservations::{Limits, TableConfig};
use crate::handoff::{HandoffMetrics, Reservations, Secret, receiver};
use crate::listener::{self, ConnLimits, Refusals};
use crate::metrics::{self, Metrics};
use crate::model::ModelSource;
use crate::model::checkpoint::Checkpoint;
use crate::roles::decode::{self, DecodeRole};
use crate::roles::discovery;
use crate::roles::internal_auth::{self, Signer, Verifier};
use crate::roles::peers::Peers;
use crate::roles::prefill::{self, PrefillRole};
use crate::roles::router::Dispatcher;
use crate::server::tokenize::SpecialTokens;
use crate::server::{self, AppState, Backend, limits};
use crate::setup;
use crate::tokenizer::Tokenizer;
use kvgate_proto::auth::Instance;

/// A role ready to serve: its bound listener and app.
pub struct Started {
    pub listener: TcpListener,
    pub app: axum::Router,
    pub ready: Arc<AtomicBool>,
    pub summary: String,
    pub limits: ConnLimits,
    pub refusals: Refusals,
    /// How long it keeps accepting once told to stop (`--shutdown-delay-ms`).
    pub shutdown_delay: Duration,
}

impl Started {
    fn new(listener: TcpListener, app: axum::Router, ready: Arc<AtomicBool>, summary: String, serve: &ServeArgs, refusals: Refusals) -> Self {
        let shutdown_delay = Duration::from_millis(serve.shutdown_delay_ms);
        Started { listener, app, ready, summary, limits: conn_limits(serve), refusals, shutdown_delay }
    }

    pub fn addr(&self) -> SocketAddr {
        server::local_addr(&self.listener)
    }

    /// Serves until `shutdown`; then, for the shutdown delay, reports not ready and still accepts
    /// (a Service's endpoints and the routers' peers drop a terminating pod a moment after it is
    /// told to stop: whoever still sends to it in that moment is answered), then stops accepting
    /// and finishes what is in flight.
    pub async fn serve(self, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        let (ready, delay) = (self.ready.clone(), self.shutdown_delay);
        let shutdown = async move {
            shutdown.await;
            if !delay.is_zero() {
                ready.store(false, std::sync::atomic::Ordering::SeqCst);
                tracing::info!(delay_ms = delay.as_millis() as u64, "stopping: not ready, still accepting for the shutdown delay");
                tokio::time::sleep(delay).await;
                tracing::info!("stopping: no new connection; finishing those in flight");
            }
        };
        listener::serve(self.listener, self.app, self.limits, self.refusals, self.ready, shutdown).await?;
        Ok(())
    }
}

fn conn_limits(a: &ServeArgs) -> ConnLimits {
    ConnLimits {
        max_connections: a.max_connections as usize,
        per_client: a.max_connections_per_client as usize,
        idle: Duration::from_millis(a.idle_timeout_ms),
    }
}

async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))
}

/// The role's engine and capacity report; the report names `me`, the process callers sign for.
fn start_engine(
    engine: &EngineArgs,
    sched: &SchedulerArgs,
    registry: &prometheus::Registry,
    role: &str,
    me: Option<Instance>,
) -> anyhow::Result<(Engine, kvgate_proto::CapacityReport)> {
    let loaded = setup::load(engine)?;
    let config = sched.config();
    let window = engine.context_window as usize;
    let e = Engine::start(loaded.model, loaded.pool, window, Metrics::new(registry, role), config);
    let report = kvgate_proto::CapacityReport { instance: me.map(|i| i.to_string()).unwrap_or_default(), ..loaded.report };
    Ok((e, report))
}

fn describe(role: &str, r: &kvgate_proto::CapacityReport, window: u64) -> String {
    format!(
        "{role}: model {}, KV pool {} tokens = {} pages x {} on {} as {}, context window {window} tokens",
        r.model, r.capacity_tokens, r.num_pages, r.page_size, r.device, r.dtype
    )
}

/// One engine that prefills and decodes itself, behind the OpenAI API (`local --colocated`).
pub async fn colocated(args: &LocalArgs, registry: &prometheus::Registry) -> anyhow::Result<Started> {
    let (engine, report) = start_engine(&args.engine, &args.scheduler, registry, "local", None)?;
    let summary = describe("colocated", &report, args.engine.context_window);
    let state = AppState::for_engine(engine, report, registry.clone(), &args.serve).with_tenants(tenants(&args.tenants, registry, "local")?);
    let ready = state.ready.clone();
    let refusals = Refusals::new(registry, "local");
    Ok(Started::new(bind(args.listen).await?, server::app(state), ready, summary, &args.serve, refusals))
}

/// The public API's tenants (keys read once here; read again in the background).
fn tenants(args: &crate::cli::TenantArgs, registry: &prometheus::Registry, role: &str) -> anyhow::Result<Arc<crate::tenants::Tenants>> {
    let tenants = crate::tenants::Tenants::from_args(args, registry, role).map_err(anyhow::Error::msg)?;
    tenants.spawn_reload();
    Ok(tenants)
}

/// The deployment's secret for a role that talks to its peers. There is no "auth off": a role
/// without the secret does not start (`local` makes a random one for its three roles).
pub fn secret(args: &SecretArgs, role: &str) -> anyhow::Result<Secret> {
    let path = args.handoff_secret_file.as_ref().with_context(|| {
        format!("the {role} role needs --handoff-secret-file (or KVGATE_HANDOFF_SECRET_FILE): every call between roles is signed with the deployment's secret")
    })?;
    Ok(Secret::from_file(path)?)
}

/// Wraps a role's internal routes in the signature check (for calls signed to `me`) and the
/// window-sized body limit.
fn internal(routes: axum::Router, secret: &Secret, me: Instance, window: u64, registry: &prometheus::Registry, role: &str) -> axum::Router {
    let limit = limits::internal_body(window as usize);
    let verifier = Verifier::new(secret, me, limit, registry, role);
    routes.layer(axum::middleware::from_fn_with_state(verifier, internal_auth::require_signature)).layer(DefaultBodyLimit::max(limit))
}

pub async fn decode(args: &DecodeArgs, registry: &prometheus::Registry, secret: Secret) -> anyhow::Result<Started> {
    let me = Instance::random();
    let (engine, report) = start_engine(&args.engine, &args.scheduler, registry, "decode", Some(me))?;
    let kv = bind(args.kv_listen).await?;
    let kv_addr = args.kv_advertise.clone().unwrap_or_else(|| server::local_addr(&kv).to_string());
    let handoff_metrics = HandoffMetrics::new(registry, "decode");
    let h = &args.handoff;
    let config = TableConfig {
        timeout: Duration::from_millis(h.handoff_timeout_ms),
        limits: Limits { window: args.engine.context_window as usize, vocab: engine.model.vocab_size(), max_open: h.max_open_reservations as usize },
        kv_addr,
        model_fingerprint: report.model_fingerprint.clone(),
        layout_fingerprint: report.layout_fingerprint.clone(),
    };
    let kv_addr = config.kv_addr.clone();
    let table = Arc::new(Reservations::new(engine.pool.clone(), secret.clone(), config, handoff_metrics).map_err(anyhow::Error::msg)?);
    let port = receiver::PortLimits {
        max_connections: h.kv_max_connections as usize,
        max_unauthenticated: h.kv_max_unauthenticated as usize,
        max_unauthenticated_per_client: h.kv_max_unauthenticated_per_client as usize,
        auth_timeout: Duration::from_millis(h.kv_auth_timeout_ms),
        frame_timeout: Duration::from_millis(h.kv_frame_timeout_ms),
    };
    let refusals = Refusals::new(registry, "decode");
    tokio::spawn(receiver::serve(kv, table.clone(), port, refusals.clone()));
    let sweeper = table.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            sweeper.expire();
        }
    });
    let summary = format!("{} (KV port {kv_addr})", describe("decode", &report, args.engine.context_window));
    let state = AppState::for_engine(engine.clone(), report, registry.clone(), &args.serve).signed_by(&secret, &args.engine);
    let ready = state.ready.clone();
    let role = DecodeRole { engine, reservations: table, admission_timeout: Duration::from_millis(args.scheduler.admission_timeout_ms) };
    let app = server::ops(state).merge(internal(decode::routes(role), &secret, me, args.engine.context_window, registry, "decode"));
    Ok(Started::new(bind(args.listen).await?, app, ready, summary, &args.serve, refusals))
}

pub async fn prefill(args: &PrefillArgs, registry: &prometheus::Registry, secret: Secret, exit_on_death: bool) -> anyhow::Result<Started> {
    let me = Instance::random();
    let (engine, mut report) = start_engine(&args.engine, &args.scheduler, registry, "prefill", Some(me))?;
    let probe = (args.prefill_probe_tokens).min(args.engine.context_window).min(report.capacity_tokens) as usize;
    report.prefill_timings = crate::roles::prefill_rate::measure(&engine, probe).await;
    let summary = describe("prefill", &report, args.engine.context_window);
    let state = AppState::for_engine(engine.clone(), report, registry.clone(), &args.serve).signed_by(&secret, &args.engine);
    let ready = state.ready.clone();
    let role = PrefillRole { engine, secret: secret.clone(), metrics: HandoffMetrics::new(registry, "prefill") };
    let routes = prefill_routes(role, exit_on_death)?;
    let app = server::ops(state).merge(internal(routes, &secret, me, args.engine.context_window, registry, "prefill"));
    Ok(Started::new(bind(args.listen).await?, app, ready, summary, &args.serve, Refusals::new(registry, "prefill")))
}

pub async fn router(args: &RouterArgs, registry: &prometheus::Registry, secret: Secret) -> anyhow::Result<Started> {
    let (name, tokenizer, special, vocab) = match &args.model {
        ModelSource::Tiny => ("tiny".to_string(), Tokenizer::Bytes, SpecialTokens::default(), crate::model::tiny::config().vocab_size),
        // The router computes nothing, but reads the config as the workers do: a checkpoint
        // they refuse, it refuses too.
        ModelSource::Dir(dir) => {
            let ckpt = Checkpoint::open(dir)?;
            let tokenizer = Tokenizer::from_file(&ckpt.tokenizer)?;
            let special = SpecialTokens::of(&tokenizer, ckpt.config.bos_token_id, &ckpt.config.eos_ids());
            (args.model.name(), tokenizer, special, ckpt.config.vocab_size)
        }
        ModelSource::Gguf(file) => {
            let gguf = crate::model::gguf::Gguf::open(file)?;
            let tokenizer = gguf.tokenizer()?;
            let special = SpecialTokens::of(&tokenizer, gguf.config.bos_token_id, &gguf.config.eos_ids());
            (args.model.name(), tokenizer, special, gguf.config.vocab_size)
        }
    };
    let metrics = Metrics::new(registry, "router");
    metrics.context_window_tokens.set(args.context_window as i64);
    let window = args.context_window as usize;
    let backend = Dispatcher::new(Arc::new(Peers::new(&args.prefill, &args.decode)), window, metrics.clone(), Signer::new(&secret));
    backend.peers.refresh(&backend.http).await;
    backend.spawn_refresh(Duration::from_secs(5));
    let peers_text = match (&args.prefill_service, &args.decode_service) {
        (Some(prefill), Some(decode)) => {
            let mut config = kube::Config::infer().await.context("connecting to the API server for peer discovery")?;
            config.headers.push((http::header::USER_AGENT, http::HeaderValue::from_static(discovery::USER_AGENT)));
            let client = kube::Client::try_from(config).context("connecting to the API server for peer discovery")?;
            let services = discovery::Services { namespace: args.namespace.clone(), prefill: prefill.clone(), decode: decode.clone() };
            tokio::spawn(discovery::run(client, services, backend.peers.clone(), backend.http.clone()));
            format!("peers from EndpointSlices of services {prefill} and {decode} in {}", args.namespace)
        }
        _ => format!("prefill {:?}, decode {:?}", args.prefill, args.decode),
    };
    let state = AppState {
        backend: Backend::Remote(backend),
        tokenizer: Arc::new(tokenizer),
        model_name: name,
        // The router checks token ids against the vocabulary as the workers do (it reads the
        // same config), so `/detokenize` and token-id prompts fail alike in every mode.
        vocab: Some(vocab),
        special,
        window,
        metrics,
        report: None,
        report_signer: None,
        ready: Arc::new(AtomicBool::new(true)),
        registry: registry.clone(),
        in_flight: server::fairness::in_flight(args.serve.max_requests_per_client as usize),
        tenants: tenants(&args.tenants, registry, "router")?,
    };
    let summary = format!("router: {peers_text}, context window {window} tokens");
    let ready = state.ready.clone();
    Ok(Started::new(bind(args.listen).await?, server::app(state), ready, summary, &args.serve, Refusals::new(registry, "router")))
}

/// A registry with the build info every process exports.
pub fn registry() -> prometheus::Registry {
    let r = prometheus::Registry::new();
    metrics::register_build_info(&r);
    r
}

/// Runs one role until SIGTERM / Ctrl-C.
pub async fn run_single(started: Started) -> anyhow::Result<()> {
    kvgate_telemetry::announce(&format!("kvgate-worker listening on http://{} ({})", started.addr(), started.summary));
    started.serve(super::shutdown_signal()).await
}

/// Faults are asked for through the environment (`handoff::faults`), and only a `testing` build
/// has them: a release build asked for one refuses to start rather than serve honestly under a
/// test that expects the fault.
pub fn fault_check() -> anyhow::Result<()> {
    #[cfg(feature = "testing")]
    crate::handoff::faults::Injection::from_env()?;
    #[cfg(not(feature = "testing"))]
    refuse_fault_in_release(std::env::var_os(RELEASE_FAULT_VAR).is_some())?;
    Ok(())
}

/// The variable a release build checks: it knows no fault, only that one was asked for.
#[cfg(not(feature = "testing"))]
const RELEASE_FAULT_VAR: &str = "KVGATE_INJECT_FAULT";

#[cfg(any(test, not(feature = "testing")))]
fn refuse_fault_in_release(asked: bool) -> anyhow::Result<()> {
    anyhow::ensure!(
        !asked,
        "KVGATE_INJECT_FAULT is set, but this kvgate-worker was built without fault injection (cargo feature `testing`, which the tests and benchmarks enable; images and `make run` do not)"
    );
    Ok(())
}

/// The prefill route: the honest one, or (a `testing` build asked for a fault) the one that
/// wraps it in the fault.
#[cfg(feature = "testing")]
fn prefill_routes(role: PrefillRole, exit_on_death: bool) -> anyhow::Result<axum::Router> {
    use crate::roles::prefill_faults::{self, Injector};
    Ok(match Injector::new(crate::handoff::faults::Injection::from_env()?, exit_on_death) {
        Some(injector) => prefill_faults::routes(role, injector),
        None => prefill::routes(role),
    })
}

#[cfg(not(feature = "testing"))]
fn prefill_routes(role: PrefillRole, _: bool) -> anyhow::Result<axum::Router> {
    fault_check()?;
    Ok(prefill::routes(role))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_release_build_refuses_a_fault_it_was_asked_for() {
        let message = refuse_fault_in_release(true).unwrap_err().to_string();
        assert!(message.contains("KVGATE_INJECT_FAULT") && message.contains("built without fault injection") && message.contains("`testing`"), "{message}");
        assert!(refuse_fault_in_release(false).is_ok(), "a release build asked for nothing starts");
    }
}
