//! `kvgate-worker local`: model, pool, scheduler and HTTP API in one process.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::Context;

use crate::cli::LocalArgs;
use crate::engine::{Engine, SchedulerConfig};
use crate::metrics::{self, Metrics};
use crate::server::{self, AppState};
use crate::setup;

pub async fn run(args: LocalArgs) -> anyhow::Result<()> {
    let window = args.engine.context_window as usize;
    let loaded = setup::load(&args.engine)?;
    let registry = prometheus::Registry::new();
    metrics::register_build_info(&registry);
    let metrics = Metrics::new(&registry, "local");
    let config = SchedulerConfig {
        max_batch_tokens: args.max_batch_tokens as usize,
        admission_timeout: Duration::from_millis(args.admission_timeout_ms),
    };
    let engine = Engine::start(loaded.model, loaded.pool, window, metrics, config);
    let listener = tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
    let r = &loaded.report;
    println!(
        "kvgate-worker local listening on http://{} (model {}, KV pool {} tokens = {} pages x {} on {} as {}, context window {} tokens)",
        server::local_addr(&listener),
        r.model,
        r.capacity_tokens,
        r.num_pages,
        r.page_size,
        r.device,
        r.dtype,
        window
    );
    if !r.holds(window as u64) {
        tracing::warn!(capacity = r.capacity_tokens, window, "KV pool is smaller than the context window; long prompts will get 413");
    }
    let state = AppState { engine, report: Arc::new(loaded.report), ready: Arc::new(AtomicBool::new(true)), registry };
    server::serve(listener, state, shutdown_signal()).await?;
    Ok(())
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
