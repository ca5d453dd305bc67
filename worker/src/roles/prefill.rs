//! The prefill role: computes a prompt's KV and streams it into decode's reservation. A prompt
//! that can never fit is rejected before anything is computed or sent.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use kvgate_proto::roles::{PrefillRequest, PrefillResponse};

use crate::engine::{Engine, Event, Mode, Prefilled, Rejection};
use crate::handoff::sender::{SendOutcome, Transfer};
use crate::handoff::{Fault, HandoffMetrics};
use crate::model::SamplingParams;
use crate::server::api;
use crate::server::error::ApiError;

#[derive(Clone)]
pub struct PrefillRole {
    pub engine: Engine,
    pub metrics: HandoffMetrics,
    pub fault: Option<Fault>,
    /// The fault hits handoffs number `fault_every`, `2 * fault_every`, ... (counted from 1).
    pub fault_every: u64,
    pub handoffs: Arc<AtomicU64>,
    /// A dedicated prefill process really exits for `die-mid-transfer`; `local` drops the
    /// connection instead (its other roles share the process).
    pub exit_on_death: bool,
}

pub fn routes(role: PrefillRole) -> Router {
    Router::new().route(super::PREFILL_PATH, post(prefill)).with_state(Arc::new(role))
}

async fn prefill(State(role): State<Arc<PrefillRole>>, body: Bytes) -> Response {
    let req: PrefillRequest = match api::parse(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let n = role.handoffs.fetch_add(1, Ordering::SeqCst) + 1;
    let fault = role.fault.filter(|_| n % role.fault_every == 0);
    let capacity = role.engine.pool.capacity_tokens();
    if req.prompt.is_empty() || req.prompt.len() > capacity {
        let r = Rejection::NeverFits { prompt: req.prompt.len(), max_tokens: 0, needed: req.prompt.len(), capacity };
        role.engine.metrics.rejected.with_label_values(&[r.reason()]).inc();
        if fault == Some(Fault::IgnoreRejection) && !req.prompt.is_empty() {
            // The incident's bug: the prompt is rejected, yet a one-token placeholder is
            // computed and handed off anyway, after the rejection went out.
            let role = role.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let _ = forward_placeholder(&role, req).await;
            });
        }
        return ApiError::from(r).into_response();
    }
    match run(&role, &req, fault).await {
        Ok(resp) if resp.ok => Json(resp).into_response(),
        Ok(resp) => (StatusCode::BAD_GATEWAY, Json(resp)).into_response(),
        Err(e) => ApiError::internal(e).into_response(),
    }
}

async fn compute(role: &PrefillRole, prompt: Vec<u32>) -> Result<Prefilled, String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let sampling = SamplingParams { temperature: 0.0, top_p: 1.0, seed: None };
    let mut events = role.engine.enqueue(prompt, 1, sampling, Mode::PrefillOnly { reply: tx });
    // The reply is sent before the request's event channel closes, so polling it first never
    // mistakes a finished prefill for a failed one.
    tokio::select! {
        biased;
        done = rx => done.map_err(|_| "prefill was dropped".to_string()),
        event = events.recv() => Err(match event {
            Some(Event::Rejected(r)) => r.to_string(),
            Some(Event::Failed(f)) => f.message,
            other => format!("unexpected engine event {other:?}"),
        }),
    }
}

async fn run(role: &PrefillRole, req: &PrefillRequest, fault: Option<Fault>) -> Result<PrefillResponse, String> {
    let started = Instant::now();
    let prefilled = compute(role, req.prompt.clone()).await?;
    let transfer = Transfer {
        pool: &role.engine.pool,
        lease: &prefilled.lease,
        reservation: &req.reservation,
        first_token: prefilled.first_token,
        model_fingerprint: &role.engine.model.fingerprint,
        layout_fingerprint: &role.engine.pool.layout().fingerprint(),
        fault,
        metrics: &role.metrics,
        checksums: true,
    };
    let outcome = transfer.run().await;
    role.metrics.duration.observe(started.elapsed().as_secs_f64());
    match outcome? {
        SendOutcome::Acked(ack) => {
            role.metrics.total.with_label_values(&[if ack.ok { "committed" } else { "failed" }]).inc();
            Ok(PrefillResponse { ok: ack.ok, reason: ack.reason, message: ack.message })
        }
        SendOutcome::Died => {
            if role.exit_on_death {
                tracing::error!("die-mid-transfer: exiting mid-transfer as instructed");
                std::process::exit(137);
            }
            role.metrics.total.with_label_values(&["failed"]).inc();
            Err("prefill died mid-transfer (injected fault)".into())
        }
    }
}

/// The buggy path of `ignore-rejection`: one token of the prompt, handed off as if it were all.
async fn forward_placeholder(role: &PrefillRole, mut req: PrefillRequest) -> Result<PrefillResponse, String> {
    req.prompt.truncate(1);
    run(role, &req, Some(Fault::TruncateTransfer)).await
}
