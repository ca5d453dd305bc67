//! `kvgate-operator run`: metrics and health server, leader election, the watches, and the
//! controller.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::{StreamExt, TryStreamExt};
use kube::api::Api;
use kube::runtime::controller::{Config as ControllerConfig, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};

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
use crate::watch::{self, Stores};
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
    if let Some(e) = &elector {
        tracing::info!(identity, lease = args.lease_name, "waiting for the leader Lease");
        tokio::select! {
            _ = e.acquire() => {}
            _ = stopped() => return Ok(()),
        }
        tracing::info!(identity, "leading");
    }
    metrics.leader.set(1);

    let (trigger, triggers) = Trigger::new();
    let http = crate::capacity::client();
    let index = Arc::new(Index::default());
    metrics.watch_index(
        index.clone(),
        &[crate::tasks::probes::TASK, crate::tasks::scrapes::TASK, crate::tasks::canaries::TASK, crate::tasks::serving_probes::TASK],
    );
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
        trigger,
        memory: Memory::new(index.clone()),
        index,
    });
    // Nothing is reconciled before every owned kind is listed: "not listed yet" is not "missing".
    tokio::select! {
        ready = stores.ready() => ready?,
        _ = stopped() => return Ok(()),
    }

    let (deployments, writer) = reflector::store();
    let (events_ctx, events_store) = (ctx.clone(), deployments.clone());
    let main = watcher(ids, watcher::Config::default())
        .default_backoff()
        .modify(watch::strip)
        .reflect(writer)
        .inspect_ok(move |event| match event {
            watcher::Event::Apply(d) | watcher::Event::InitApply(d) => lifecycle::seen(&events_ctx, d),
            watcher::Event::Delete(d) => lifecycle::deleted(&events_ctx, &events_store, d),
            watcher::Event::InitDone => lifecycle::sweep(&events_ctx, &events_store),
            watcher::Event::Init => {}
        })
        .touched_objects();
    let controller = Controller::for_stream(main, deployments)
        .with_config(ControllerConfig::default().concurrency(args.concurrency))
        .reconcile_on(triggers)
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
