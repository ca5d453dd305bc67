//! `kvgate-operator run`: metrics and health server, leader election, the watches, and the
//! controller.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::StreamExt;
use kube::api::Api;
use kube::runtime::controller::{Config as ControllerConfig, Controller};
use kube::runtime::events::{Recorder, Reporter};

use crate::cli::RunArgs;
use crate::crd::InferenceDeployment;
use crate::index::Index;
use crate::leader::Elector;
use crate::metrics::{self, Health, Metrics};
use crate::reconcile::{self, Context, Memory, Settings};
use crate::tasks::Trigger;
use crate::tasks::canaries::Canaries;
use crate::tasks::probes::Probes;
use crate::tasks::scrapes::Scrapes;
use crate::tasks::serving_probes::ServingProbes;
use crate::watch::Stores;
use crate::{keys, lifecycle};

/// The User-Agent of every request the operator sends.
pub const USER_AGENT: &str = concat!("kvgate-operator/", env!("CARGO_PKG_VERSION"));

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let mut config = match &args.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| anyhow::anyhow!("--kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::infer().await.map_err(|e| anyhow::anyhow!("connecting to the API server: {e}"))?,
    };
    // The API server's audit log and metrics tell the operator's requests apart by this.
    config.headers.push((http::header::USER_AGENT, http::HeaderValue::from_static(USER_AGENT)));
    let client = kube::Client::try_from(config)?;
    kvgate_heap::give_back_freed_memory();
    let metrics = Metrics::new();
    let health = Health::default();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    tokio::spawn(metrics::serve(args.metrics_addr, metrics.clone(), health.clone(), stopped()));
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    });

    let ids: Api<InferenceDeployment> = match &args.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    // Fail early and clearly when the CRD is not installed.
    ids.list(&kube::api::ListParams::default().limit(1))
        .await
        .map_err(|e| anyhow::anyhow!("listing InferenceDeployments ({e}): is the CRD installed? `kubectl apply -f crds/`"))?;
    let own_namespace = args.lease_namespace.clone().unwrap_or_else(|| "default".into());
    let root = keys::load_or_create(&client, &own_namespace, &args.root_key_secret).await?;
    health.ready.store(true, Ordering::SeqCst);
    kvgate_telemetry::announce(&format!("kvgate-operator: metrics on http://{}", args.metrics_addr));

    let identity = args.identity.clone().unwrap_or_else(hostname);
    let elector = args.leader_elect.then(|| Elector::new(client.clone(), &own_namespace, &args.lease_name, &identity));
    // A cold standby watches nothing until it leads; a warm one (the default) keeps every store
    // current and holds back only its writers, so a failover needs no list.
    let index = Arc::new(Index::default());
    metrics.watch_index(index.clone());
    if args.cold_standby && !lead(elector.as_ref(), &identity, stopped()).await {
        return Ok(());
    }

    let (trigger, triggers) = Trigger::held();
    let http = crate::capacity::client();
    let probes = Probes::new(http.clone(), trigger.clone(), index.clone());
    let pods_gone = probes.clone();
    let stores = Stores::start(&client, args.namespace.as_deref(), &trigger, move |pod| pods_gone.forget_pod(&pod.metadata.uid.clone().unwrap_or_default()));
    let recorder = Recorder::new(client.clone(), Reporter { controller: "kvgate-operator".into(), instance: Some(identity.clone()) });
    let ctx = Arc::new(Context {
        client: client.clone(),
        metrics: metrics.clone(),
        recorder,
        settings: Settings {
            worker_image: args.worker_image.clone(),
            worker_telemetry: crate::render::workers::Telemetry {
                log: args.worker_log_format,
                otlp_endpoint: args.worker_otlp_endpoint.clone().filter(|e| !e.is_empty()),
            },
            allowed_host_paths: args.allowed_host_paths.clone(),
        },
        root,
        stores: stores.clone(),
        probes,
        scrapes: Scrapes::new(http.clone(), trigger.clone(), index.clone()),
        serving_probes: ServingProbes::new(http.clone(), trigger.clone(), metrics.clone(), index.clone()),
        canaries: Canaries::new(http, trigger.clone(), metrics.clone(), index.clone()),
        trigger: trigger.clone(),
        memory: Memory::new(index.clone()),
        index,
    });
    let deployments = lifecycle::watch(ids, ctx.clone());
    // Nothing is reconciled before every kind is listed: "not listed yet" is not "missing".
    tokio::select! {
        ready = async { stores.ready().await?; deployments.wait_until_ready().await.map_err(|e| anyhow::anyhow!("the InferenceDeployment watch stopped before its first list: {e}")) } => ready?,
        _ = stopped() => return Ok(()),
    }
    metrics.synced.set(1);
    if !args.cold_standby && !lead(elector.as_ref(), &identity, stopped()).await {
        return Ok(());
    }
    metrics.leader.set(1);

    // Every deployment once now (what changed while standing by included), then as they change.
    trigger.open();
    let controller = Controller::for_stream(futures::stream::pending::<Result<InferenceDeployment, kube::runtime::watcher::Error>>(), deployments)
        .with_config(ControllerConfig::default().concurrency(args.concurrency))
        .reconcile_on(triggers)
        .reconcile_all_on(futures::stream::once(async {}))
        .graceful_shutdown_on(stopped())
        .run(reconcile::reconcile, reconcile::error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "controller");
            }
        });
    let result = match &elector {
        Some(e) => tokio::select! {
            _ = controller => Ok(()),
            lost = e.keep() => Err(lost),
        },
        None => {
            controller.await;
            Ok(())
        }
    };
    metrics.leader.set(0);
    if let Some(e) = &elector {
        e.release().await;
    }
    tracing::info!("stopped");
    result
}

/// Waits for the Lease (at once without an election); false when stopped first.
async fn lead(elector: Option<&Elector>, identity: &str, stopped: impl std::future::Future<Output = ()>) -> bool {
    let Some(e) = elector else { return true };
    tracing::info!(identity, lease = e.name(), "waiting for the leader Lease");
    tokio::select! {
        _ = e.acquire() => {}
        _ = stopped => return false,
    }
    tracing::info!(identity, "leading");
    true
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| format!("kvgate-operator-{}", std::process::id()))
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
