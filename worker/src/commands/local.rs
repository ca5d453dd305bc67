//! `kvgate-worker local`: router, prefill and decode in one process, each on its own loopback
//! listener and talking over real sockets; or, with `--colocated`, one engine doing both.

use std::net::SocketAddr;

use crate::cli::{DecodeArgs, LocalArgs, PrefillArgs, RouterArgs};

use super::roles;
use crate::handoff::Secret;

pub async fn run(args: LocalArgs) -> anyhow::Result<()> {
    roles::fault_check()?;
    let registry = roles::registry();
    if args.colocated {
        return colocated(args, registry).await;
    }
    let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
    // The three roles authenticate each other exactly as in a cluster, with a secret of their
    // own unless one is given.
    let secret = match &args.handoff.secret.handoff_secret_file {
        Some(_) => roles::secret(&args.handoff.secret, "local")?,
        None => Secret::random(),
    };
    let decode = roles::decode(
        &DecodeArgs {
            listen: loopback,
            kv_listen: loopback,
            kv_advertise: None,
            serve: args.serve.clone(),
            engine: args.engine.clone(),
            scheduler: args.scheduler.clone(),
            handoff: args.handoff.clone(),
        },
        &registry,
        secret.clone(),
    )
    .await?;
    let prefill = roles::prefill(
        &PrefillArgs {
            listen: loopback,
            serve: args.serve.clone(),
            engine: args.engine.clone(),
            scheduler: args.scheduler.clone(),
            secret: args.handoff.secret.clone(),
            prefill_probe_tokens: 0, // nobody reads the report of `local`'s prefill
        },
        &registry,
        secret.clone(),
        false,
    )
    .await?;
    let (decode_addr, prefill_addr) = (decode.addr(), prefill.addr());
    kvgate_telemetry::announce(&format!("  {} on http://{decode_addr}", decode.summary));
    kvgate_telemetry::announce(&format!("  {} on http://{prefill_addr}", prefill.summary));
    tokio::spawn(decode.serve(std::future::pending()));
    tokio::spawn(prefill.serve(std::future::pending()));
    let router = roles::router(
        &RouterArgs {
            listen: args.listen,
            prefill: vec![prefill_addr.to_string()],
            decode: vec![decode_addr.to_string()],
            model: args.engine.model.clone(),
            context_window: args.engine.context_window,
            prefill_service: None,
            decode_service: None,
            namespace: String::new(),
            serve: args.serve.clone(),
            tenants: args.tenants.clone(),
            secret: args.handoff.secret.clone(),
        },
        &registry,
        secret,
    )
    .await?;
    kvgate_telemetry::announce(&format!(
        "kvgate-worker local listening on http://{} (router -> prefill {prefill_addr} -> decode {decode_addr})",
        router.addr()
    ));
    router.serve(shutdown_signal()).await
}

async fn colocated(args: LocalArgs, registry: prometheus::Registry) -> anyhow::Result<()> {
    let started = roles::colocated(&args, &registry).await?;
    kvgate_telemetry::announce(&format!("kvgate-worker local listening on http://{} ({})", started.addr(), started.summary));
    started.serve(shutdown_signal()).await
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down");
}
