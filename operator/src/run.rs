//! `kvgate-operator run`: metrics and health server, leader election, and the controller.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::controller::Controller;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;

use crate::cli::RunArgs;
use crate::crd::InferenceDeployment;
use crate::leader::Elector;
use crate::metrics::{self, Health, Metrics};
use crate::reconcile::{self, Context};
use crate::render::labels;

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let client = match &args.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| anyhow::anyhow!("--kubeconfig {}: {e}", path.display()))?;
            kube::Client::try_from(kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?)?
        }
        None => kube::Client::try_default().await.map_err(|e| anyhow::anyhow!("connecting to the API server: {e}"))?,
    };
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
    health.ready.store(true, Ordering::SeqCst);
    println!("kvgate-operator: metrics on http://{}", args.metrics_addr);

    let identity = args.identity.clone().unwrap_or_else(hostname);
    let elector = args.leader_elect.then(|| Elector::new(client.clone(), args.lease_namespace.as_deref().unwrap_or("default"), &args.lease_name, &identity));
    if let Some(e) = &elector {
        tracing::info!(identity, lease = args.lease_name, "waiting for the leader Lease");
        tokio::select! {
            _ = e.acquire() => {}
            _ = stopped() => return Ok(()),
        }
        tracing::info!(identity, "leading");
    }
    metrics.leader.set(1);

    let (deployments, pods) = match &args.namespace {
        Some(ns) => (Api::<Deployment>::namespaced(client.clone(), ns), Api::<Pod>::namespaced(client.clone(), ns)),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let recorder = Recorder::new(client.clone(), Reporter { controller: "kvgate-operator".into(), instance: Some(identity.clone()) });
    let ctx = Arc::new(Context {
        worker_log_format: args.worker_log_format,
        ..Context::new(client.clone(), metrics.clone(), recorder, args.worker_image.clone(), args.allowed_host_paths.clone())
    });
    let managed = watcher::Config::default().labels(&format!("{}={}", labels::MANAGED_BY, labels::OPERATOR));
    // Pods are owned by ReplicaSets, not by us: map them to their deployment by label.
    let pod_owner = |pod: Pod| {
        let name = pod.metadata.labels.as_ref()?.get(labels::INSTANCE)?.clone();
        Some(ObjectRef::<InferenceDeployment>::new(&name).within(pod.metadata.namespace.as_deref()?))
    };
    let controller = Controller::new(ids, watcher::Config::default())
        .owns(deployments, managed.clone())
        .watches(pods, watcher::Config::default().labels(&format!("{},{}", labels::INSTANCE, labels::REVISION)), pod_owner)
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
