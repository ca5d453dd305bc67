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
use kvgate_proto::roles::{PrefillRequest, PrefillResponse, Sampling};
use kvgate_telemetry::trace_context::mark_failed;
use tracing::Instrument;
use tracing::field::Empty;

use crate::engine::{Engine, Event, Mode, Prefilled, Rejection};
use crate::handoff::sender::{SendError, SendOutcome, Transfer, check_reservation};
use crate::handoff::{Fault, HandoffMetrics, Secret, faults};
use crate::model::SamplingParams;
use crate::server::api;
use crate::server::error::ApiError;

#[derive(Clone)]
pub struct PrefillRole {
    pub engine: Engine,
    pub secret: Secret,
    pub metrics: HandoffMetrics,
    pub fault: Option<Fault>,
    /// The fault hits handoffs number `fault_after + fault_every`, `fault_after + 2 * fault_every`,
    /// ... (counted from 1).
    pub fault_every: u64,
    pub fault_after: u64,
    pub handoffs: Arc<AtomicU64>,
    /// A dedicated prefill process really exits for `die-mid-transfer`; `local` drops the
    /// connection instead (its other roles share the process).
    pub exit_on_death: bool,
}

/// The internal route; the caller wraps it in the signature check.
pub fn routes(role: PrefillRole) -> Router {
    Router::new().route(super::PREFILL_PATH, post(prefill)).with_state(Arc::new(role))
}

fn reservation_error(e: SendError) -> ApiError {
    ApiError {
        status: StatusCode::BAD_REQUEST,
        kind: "invalid_request_error",
        code: "reservation_invalid".into(),
        param: Some("reservation".into()),
        message: e.to_string(),
    }
}

async fn prefill(State(role): State<Arc<PrefillRole>>, body: Bytes) -> Response {
    let req: PrefillRequest = match api::parse(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let span = tracing::info_span!(
        "prefill",
        otel.kind = "server",
        otel.status_code = Empty,
        otel.status_description = Empty, error.type = Empty,
        trace_id = Empty,
        span_id = Empty,
        handoff_id = %req.reservation.handoff_id,
        prompt_tokens = req.prompt.len() as i64,
    );
    super::join_trace(&span, req.traceparent.as_deref());
    handle(role, req).instrument(span).await
}

async fn handle(role: Arc<PrefillRole>, req: PrefillRequest) -> Response {
    let n = role.handoffs.fetch_add(1, Ordering::SeqCst) + 1;
    let fault = role.fault.filter(|_| faults::hits(n, role.fault_after, role.fault_every));
    // The incident's bug touches only what prefill rejects: a prompt that fits is prefilled,
    // checked and sent like any other (`forward_placeholder` is the bug's own path).
    let (ignores_rejections, fault) = match fault {
        Some(Fault::IgnoreRejection) => (true, None),
        other => (false, other),
    };
    let vocab = role.engine.model.vocab_size();
    if let Some(at) = req.prompt.iter().position(|t| *t as usize >= vocab) {
        let message = format!("prompt token {} at position {at} is outside the vocabulary of {vocab} tokens", req.prompt[at]);
        return ApiError::invalid(format!("prompt[{at}]"), message).into_response();
    }
    let layout = *role.engine.pool.layout();
    let capacity = role.engine.pool.capacity_tokens();
    let rejected = req.prompt.is_empty() || req.prompt.len() > capacity;
    // Nothing is computed, and no address dialled, for a reservation decode did not mint (the
    // bug's placeholder for a rejected prompt skips this: its lease is not the reservation's).
    if !(rejected && ignores_rejections)
        && let Err(e) = check_reservation(&req.reservation, &role.secret, req.prompt.len(), &layout.fingerprint(), layout.page_size)
    {
        return reservation_error(e).into_response();
    }
    if rejected {
        let r = Rejection::NeverFits { prompt: req.prompt.len(), max_tokens: 0, needed: req.prompt.len(), capacity };
        role.engine.metrics.rejected.with_label_values(&[r.reason()]).inc();
        if ignores_rejections && !req.prompt.is_empty() {
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
    let outcome = run(&role, &req, fault).await;
    #[cfg(feature = "testing")]
    crate::handoff::restart_fault::handoff_done(n);
    match outcome {
        Ok(resp) if resp.ok => Json(resp).into_response(),
        Ok(resp) => {
            // Decode refused the handoff: the prefill span fails with decode's reason.
            mark_failed(&tracing::Span::current(), &resp.reason);
            (StatusCode::BAD_GATEWAY, Json(resp)).into_response()
        }
        Err(Failed::Send(e @ SendError::Reservation(_))) => reservation_error(e).into_response(),
        Err(Failed::Deadline(message)) => deadline_error(message).into_response(),
        Err(e) => ApiError::internal(e.to_string()).into_response(),
    }
}

/// Why a prefill did not end with decode's ack.
#[derive(Debug, thiserror::Error)]
enum Failed {
    #[error("computing the prompt's KV: prefill was dropped")]
    Dropped,
    #[error("computing the prompt's KV: {0}")]
    Rejected(Rejection),
    #[error("computing the prompt's KV: {0}")]
    Engine(String),
    #[error(transparent)]
    Send(#[from] SendError),
    #[error("prefill died mid-transfer (injected fault)")]
    Died,
    #[error("computing the prompt's KV: {0}")]
    Deadline(String),
}

/// Prefill ran out of the reservation's time: a server-side timeout, never a client error.
fn deadline_error(message: String) -> ApiError {
    ApiError { status: StatusCode::GATEWAY_TIMEOUT, kind: "server_error", code: "prefill_deadline_exceeded".into(), param: None, message }
}

async fn compute(role: &PrefillRole, prompt: Vec<u32>, sampling: Option<Sampling>) -> Result<Prefilled, Failed> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let sampling = sampling.map_or_else(SamplingParams::default, SamplingParams::from);
    let mut events = role.engine.enqueue(prompt, 1, sampling, Mode::PrefillOnly { reply: tx });
    // The reply is sent before the request's event channel closes, so polling it first never
    // mistakes a finished prefill for a failed one.
    tokio::select! {
        biased;
        done = rx => done.map_err(|_| Failed::Dropped),
        event = events.recv() => Err(match event {
            Some(Event::Rejected(r)) => Failed::Rejected(r),
            Some(Event::Failed(f)) => Failed::Engine(f.message),
            other => Failed::Engine(format!("unexpected engine event {other:?}")),
        }),
    }
}

async fn run(role: &PrefillRole, req: &PrefillRequest, fault: Option<Fault>) -> Result<PrefillResponse, Failed> {
    let started = Instant::now();
    // The work is bounded by the reservation's deadline: past it decode frees the pages, so
    // computing on is wasted (and, dropped, the prompt leaves the batch at its next chunk).
    let left = Duration::from_millis(req.reservation.expires_ms.saturating_sub(kvgate_proto::auth::now_ms()));
    let tokens = req.prompt.len();
    let prefilled = tokio::time::timeout(left, compute(role, req.prompt.clone(), req.sampling)).await.map_err(|_| {
        Failed::Deadline(format!(
            "{tokens} prompt tokens were not prefilled within the reservation's {} ms (--handoff-timeout-ms on decode); this worker cannot prefill prompts this long in time",
            left.as_millis()
        ))
    })??;
    let transfer = Transfer {
        pool: &role.engine.pool,
        lease: &prefilled.lease,
        // The incident's bug takes its one-token placeholder for the whole prompt.
        prompt_tokens: if fault == Some(Fault::IgnoreRejection) { req.reservation.reserved_tokens as usize } else { prefilled.lease.tokens() },
        reservation: &req.reservation,
        secret: &role.secret,
        first_token: prefilled.first_token,
        first_logprobs: prefilled.first_logprobs.clone(),
        model_fingerprint: &role.engine.model.fingerprint,
        layout_fingerprint: &role.engine.pool.layout().fingerprint(),
        metrics: &role.metrics,
        integrity: true,
    };
    let span = tracing::info_span!("handoff_send", pages = Empty, bytes = Empty, integrity_seconds = Empty, otel.status_code = Empty, otel.status_description = Empty, error.type = Empty);
    let outcome = send(&transfer, fault).instrument(span.clone()).await;
    match &outcome {
        Ok(SendOutcome::Acked(ack)) if !ack.ok => mark_failed(&span, &ack.reason),
        Err(e) => mark_failed(&span, &e.to_string()),
        _ => {}
    }
    role.metrics.duration.observe(started.elapsed().as_secs_f64());
    match outcome? {
        SendOutcome::Acked(ack) => {
            role.metrics.total.with_label_values(&[if ack.ok { "committed" } else { "failed" }]).inc();
            Ok(PrefillResponse { ok: ack.ok, reason: ack.reason, message: ack.message, prompt_logprobs: prefilled.prompt_logprobs.clone() })
        }
        SendOutcome::Died => {
            if role.exit_on_death {
                tracing::error!("die-mid-transfer: exiting mid-transfer as instructed");
                std::process::exit(137);
            }
            role.metrics.total.with_label_values(&["failed"]).inc();
            Err(Failed::Died)
        }
    }
}

/// The transfer, through the fault decorator when this handoff gets a fault (faults exist only in
/// a `testing` build; any other build refuses `--inject-fault` at start-up).
async fn send(transfer: &Transfer<'_>, fault: Option<Fault>) -> Result<SendOutcome, SendError> {
    match fault {
        #[cfg(feature = "testing")]
        Some(fault) => {
            let port = crate::handoff::sender::KvConnection::new(&transfer.reservation.kv_addr, transfer.metrics);
            transfer.run_into(crate::handoff::faulty::Faulty::new(fault, port, transfer.secret, transfer.reservation)).await
        }
        _ => transfer.run().await,
    }
}

/// The buggy path of `ignore-rejection`: one token of the prompt, handed off as if it were all.
async fn forward_placeholder(role: &PrefillRole, mut req: PrefillRequest) -> Result<PrefillResponse, Failed> {
    req.prompt.truncate(1);
    run(role, &req, Some(Fault::IgnoreRejection)).await
}
