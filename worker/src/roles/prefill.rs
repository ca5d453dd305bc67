//! The prefill role: computes a prompt's KV and streams it into decode's reservation. A prompt
//! that can never fit is rejected before anything is computed or sent. This is the honest
//! prefill only: a testing build's faults (`prefill_faults.rs`) wrap it, chosen at start-up.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use kvgate_proto::handoff::AckFrame;
use kvgate_proto::refusal::Mismatch;
use kvgate_proto::roles::{PrefillRequest, PrefillResponse, Sampling};
use kvgate_telemetry::trace_context::mark_failed;
use tracing::Instrument;
use tracing::field::Empty;

use crate::engine::{Engine, Event, Mode, Prefilled, Rejection};
use crate::handoff::sender::{SendError, SendOutcome, Transfer, check_reservation};
use crate::handoff::{HandoffMetrics, Secret};
use crate::model::SamplingParams;
use crate::server::api;
use crate::server::error::ApiError;

#[derive(Clone)]
pub struct PrefillRole {
    pub engine: Engine,
    pub secret: Secret,
    pub metrics: HandoffMetrics,
}

/// The internal route; the caller wraps it in the signature check.
pub fn routes(role: PrefillRole) -> Router {
    Router::new().route(super::PREFILL_PATH, post(prefill)).with_state(Arc::new(role))
}

fn reservation_error(e: SendError) -> ApiError {
    ApiError {
        status: StatusCode::BAD_REQUEST,
        kind: "invalid_request_error",
        code: kvgate_proto::codes::ErrorCode::ReservationInvalid,
        param: Some("reservation".into()),
        message: e.to_string(),
    }
}

async fn prefill(State(role): State<Arc<PrefillRole>>, body: Bytes) -> Response {
    match request(&body) {
        Ok((req, span)) => handle(role, req, &Honest).instrument(span).await,
        Err(refused) => refused.into_response(),
    }
}

/// The request and its span (joined to the caller's trace).
pub(crate) fn request(body: &Bytes) -> Result<(PrefillRequest, tracing::Span), ApiError> {
    let req: PrefillRequest = api::parse(body)?;
    let span = tracing::info_span!(
        "prefill",
        otel.kind = "server",
        otel.status_code = Empty,
        otel.status_description = Empty, error.type = Empty,
        trace_id = Empty,
        span_id = Empty,
        handoff_id = %req.reservation.handoff_id,
        tenant = %req.tenant,
        prompt_tokens = req.prompt.len() as i64,
    );
    super::join_trace(&span, req.traceparent.as_deref());
    Ok((req, span))
}

/// Checks the request (vocabulary, reservation, the pool's room), then prefills it and sends
/// its KV `via` the honest transfer or (a testing build) a fault.
pub(crate) async fn handle(role: Arc<PrefillRole>, req: PrefillRequest, via: &impl Via) -> Response {
    if let Err(refused) = vocabulary(&role, &req) {
        return refused.into_response();
    }
    if let Err(e) = reservation(&role, &req) {
        return reservation_error(e).into_response();
    }
    if let Some(r) = rejection(&role, &req) {
        return refuse(&role, r);
    }
    respond(run(&role, &req, via).await)
}

/// A prompt token outside the model's vocabulary is the caller's error, named by position.
pub(crate) fn vocabulary(role: &PrefillRole, req: &PrefillRequest) -> Result<(), ApiError> {
    let vocab = role.engine.model.vocab_size();
    match req.prompt.iter().position(|t| *t as usize >= vocab) {
        Some(at) => {
            let message = format!("prompt token {} at position {at} is outside the vocabulary of {vocab} tokens", req.prompt[at]);
            Err(ApiError::invalid(format!("prompt[{at}]"), message))
        }
        None => Ok(()),
    }
}

/// Nothing is computed, and no address dialled, for a reservation decode did not mint, nor for
/// one that holds room for another tenant than the prompt's (counted as a `tenant` mismatch).
fn reservation(role: &PrefillRole, req: &PrefillRequest) -> Result<(), SendError> {
    let layout = role.engine.pool.layout();
    check_reservation(&req.reservation, &role.secret, req.prompt.len(), &layout.fingerprint(), layout.page_size)?;
    if req.tenant != req.reservation.tenant {
        role.metrics.mismatched(Mismatch::Tenant, Some(req.tenant.as_str()));
        return Err(SendError::Reservation(format!(
            "reservation {} holds room for tenant `{}`, this prompt is tenant `{}`'s (kv_handoff_tenant)",
            req.reservation.handoff_id, req.reservation.tenant, req.tenant
        )));
    }
    Ok(())
}

/// Why the pool can never hold this prompt, if it cannot.
pub(crate) fn rejection(role: &PrefillRole, req: &PrefillRequest) -> Option<Rejection> {
    let capacity = role.engine.pool.capacity_tokens();
    let tokens = req.prompt.len();
    (tokens == 0 || tokens > capacity).then_some(Rejection::NeverFits { prompt: tokens, max_tokens: 0, needed: tokens, capacity })
}

/// The rejection, counted by reason.
pub(crate) fn refuse(role: &PrefillRole, r: Rejection) -> Response {
    role.engine.metrics.rejected.with_label_values(&[r.reason()]).inc();
    ApiError::from(r).into_response()
}

/// The answer to a prefill that ran (or failed).
pub(crate) fn respond(outcome: Result<PrefillResponse, Failed>) -> Response {
    match outcome {
        Ok(resp) => match resp.refused {
            None => Json(resp).into_response(),
            Some(reason) => {
                // Decode refused the handoff: the prefill span fails with decode's reason.
                mark_failed(&tracing::Span::current(), reason.as_str());
                (StatusCode::BAD_GATEWAY, Json(resp)).into_response()
            }
        },
        Err(Failed::Send(e @ SendError::Reservation(_))) => reservation_error(e).into_response(),
        Err(Failed::Deadline(message)) => deadline_error(message).into_response(),
        Err(e) => ApiError::internal(e.to_string()).into_response(),
    }
}

/// Why a prefill did not end with decode's ack.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Failed {
    #[error("computing the prompt's KV: prefill was dropped")]
    Dropped,
    #[error("computing the prompt's KV: {0}")]
    Rejected(Rejection),
    #[error("computing the prompt's KV: {0}")]
    Engine(String),
    #[error(transparent)]
    Send(#[from] SendError),
    /// The sink dropped the connection mid-transfer (only a testing build's fault does).
    #[error("prefill dropped the transfer mid-way")]
    Died,
    #[error("computing the prompt's KV: {0}")]
    Deadline(String),
}

/// Prefill ran out of the reservation's time: a server-side timeout, never a client error.
fn deadline_error(message: String) -> ApiError {
    ApiError { status: StatusCode::GATEWAY_TIMEOUT, kind: "server_error", code: kvgate_proto::codes::ErrorCode::PrefillDeadlineExceeded, param: None, message }
}

async fn compute(role: &PrefillRole, prompt: Vec<u32>, sampling: Option<Sampling>, tenant: &str) -> Result<Prefilled, Failed> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let sampling = sampling.map_or_else(SamplingParams::default, SamplingParams::from);
    let mut events = role.engine.enqueue(prompt, 1, sampling, Mode::PrefillOnly { reply: tx }, tenant);
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

/// How a transfer goes out and what its commit claims: honestly here; a testing build's fault
/// decorates it (`prefill_faults.rs`).
pub(crate) trait Via: Sync {
    /// The prompt tokens the commit claims, for a lease holding `computed`.
    fn claims(&self, computed: usize, _req: &PrefillRequest) -> usize {
        computed
    }
    fn send<'t>(&'t self, transfer: &'t Transfer<'t>) -> impl Future<Output = Result<SendOutcome, SendError>> + Send + 't;
}

/// The transfer as the protocol says.
pub(crate) struct Honest;

impl Via for Honest {
    fn send<'t>(&'t self, transfer: &'t Transfer<'t>) -> impl Future<Output = Result<SendOutcome, SendError>> + Send + 't {
        transfer.run()
    }
}

pub(crate) async fn run(role: &PrefillRole, req: &PrefillRequest, via: &impl Via) -> Result<PrefillResponse, Failed> {
    let started = Instant::now();
    // The work is bounded by the reservation's deadline: past it decode frees the pages, so
    // computing on is wasted (and, dropped, the prompt leaves the batch at its next chunk).
    let left = Duration::from_millis(req.reservation.expires_ms.saturating_sub(kvgate_proto::auth::now_ms()));
    let tokens = req.prompt.len();
    let prefilled = tokio::time::timeout(left, compute(role, req.prompt.clone(), req.sampling, req.tenant.as_str())).await.map_err(|_| {
        Failed::Deadline(format!(
            "{tokens} prompt tokens were not prefilled within the reservation's {} ms (--handoff-timeout-ms on decode); this worker cannot prefill prompts this long in time",
            left.as_millis()
        ))
    })??;
    let transfer = Transfer {
        pool: &role.engine.pool,
        lease: &prefilled.lease,
        prompt_tokens: via.claims(prefilled.lease.tokens(), req),
        reservation: &req.reservation,
        tenant: req.tenant.tag(),
        secret: &role.secret,
        first_token: prefilled.first_token,
        first_logprobs: prefilled.first_logprobs.clone(),
        model_fingerprint: &role.engine.model.fingerprint,
        layout_fingerprint: &role.engine.pool.layout().fingerprint(),
        metrics: &role.metrics,
    };
    let span = tracing::info_span!("handoff_send", pages = Empty, bytes = Empty, integrity_seconds = Empty, otel.status_code = Empty, otel.status_description = Empty, error.type = Empty);
    let outcome = via.send(&transfer).instrument(span.clone()).await;
    match &outcome {
        Ok(SendOutcome::Acked(AckFrame { refused: Some(reason), .. })) => mark_failed(&span, reason.as_str()),
        Err(e) => mark_failed(&span, &e.to_string()),
        _ => {}
    }
    role.metrics.duration.observe(started.elapsed().as_secs_f64());
    match outcome? {
        SendOutcome::Acked(ack) => {
            role.metrics.total.with_label_values(&[if ack.ok() { "committed" } else { "failed" }]).inc();
            Ok(PrefillResponse { refused: ack.refused, message: ack.message, prompt_logprobs: prefilled.prompt_logprobs.clone() })
        }
        SendOutcome::Died => {
            role.metrics.total.with_label_values(&["failed"]).inc();
            Err(Failed::Died)
        }
    }
}
