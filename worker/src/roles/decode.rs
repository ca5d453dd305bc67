//! The decode role: reserves pages, receives KV on its KV port, and generates only from a
//! handoff whose every check passed, within what the reservation allows.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use futures::StreamExt;
use kvgate_proto::handoff::HandoffId;
use kvgate_proto::roles::{CancelRequest, GenerateRequest, Reservation, ReserveRequest, StreamLine};
use kvgate_telemetry::trace_context::mark_failed;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tracing::Instrument;
use tracing::field::Empty;

use crate::engine::{Engine, Event, Mode, Rejection};
use crate::handoff::reservations::{Issued, ReserveError};
use crate::handoff::{HandoffRefusal, Reservations};
use crate::model::SamplingParams;
use crate::server::api;
use crate::server::error::ApiError;

#[derive(Clone)]
pub struct DecodeRole {
    pub engine: Engine,
    pub reservations: Arc<Reservations>,
    /// How long a reservation waits for free pages before it is answered 503 (as a colocated
    /// request waits for admission).
    pub admission_timeout: Duration,
}

/// The internal routes; the caller wraps them in the signature check.
pub fn routes(role: DecodeRole) -> Router {
    Router::new()
        .route(super::RESERVE_PATH, post(reserve))
        .route("/internal/v1/handoffs/{id}/cancel", post(cancel))
        .route("/internal/v1/handoffs/{id}/generate", post(generate))
        .with_state(role)
}

/// The error a failed handoff surfaces as: 502, with decode's own words.
pub fn verdict_error(v: &HandoffRefusal) -> ApiError {
    ApiError {
        status: StatusCode::BAD_GATEWAY,
        kind: "server_error",
        code: kvgate_proto::codes::ErrorCode::KvHandoff(v.reason),
        param: None,
        message: v.message.clone(),
    }
}

fn parse_id(id: &str) -> Result<HandoffId, ApiError> {
    id.parse().map_err(|e: String| ApiError::invalid("handoff_id", e))
}

/// Reserves, waiting for pages freed by running sequences up to the admission timeout.
async fn reserve_waiting(role: &DecodeRole, req: &ReserveRequest) -> Result<Issued, ReserveError> {
    let give_up = Instant::now() + role.admission_timeout;
    loop {
        let freed = role.engine.pool.freed();
        match role.reservations.reserve(req.prompt_tokens, req.max_tokens, &req.tenant) {
            Err(ReserveError::NoRoom { .. }) if Instant::now() < give_up => {
                // Woken by a release; the poll bounds the wait should a wake-up be missed.
                let wait = give_up.saturating_duration_since(Instant::now()).min(Duration::from_millis(50));
                let _ = tokio::time::timeout(wait, freed).await;
            }
            other => return other,
        }
    }
}

async fn reserve(State(role): State<DecodeRole>, body: Bytes) -> Response {
    let req: ReserveRequest = match api::parse(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let span = tracing::info_span!(
        "reserve",
        otel.kind = "server",
        trace_id = Empty,
        span_id = Empty,
        handoff_id = Empty,
        tenant = %req.tenant,
        prompt_tokens = i64::from(req.prompt_tokens),
        max_tokens = i64::from(req.max_tokens),
        pages = Empty,
    );
    let trace = super::join_trace(&span, req.traceparent.as_deref());
    let rejected = |r: Rejection| {
        role.engine.metrics.rejected.with_label_values(&[r.reason()]).inc();
        ApiError::from(r).into_response()
    };
    let waited = Instant::now();
    let reserved = reserve_waiting(&role, &req).instrument(span.clone()).await;
    if let Ok(issued) = &reserved {
        span.record("handoff_id", issued.id.to_string());
        span.record("pages", issued.pages.len() as i64);
        // The handoff's receipt and commit are checked under this trace.
        role.reservations.set_trace(issued.id, trace);
    }
    match reserved {
        Ok(issued) => Json(Reservation {
            handoff_id: issued.id,
            pages: issued.pages,
            reserved_tokens: issued.reserved_tokens,
            max_tokens: issued.max_tokens,
            expires_ms: issued.expires_ms,
            tag: issued.tag,
            kv_addr: role.reservations.kv_addr().to_string(),
            model_fingerprint: role.engine.model.fingerprint.clone(),
            layout_fingerprint: role.engine.pool.layout().fingerprint(),
            tenant: issued.tenant,
        })
        .into_response(),
        Err(ReserveError::Invalid { field, message }) => ApiError::invalid(field, message).into_response(),
        Err(ReserveError::ContextLength { prompt, max_tokens, window }) => {
            let (prompt, max_tokens) = (prompt as usize, max_tokens as usize);
            rejected(Rejection::ContextLength { prompt, max_tokens, total: prompt + max_tokens, window })
        }
        Err(ReserveError::NeverFits { needed, capacity }) => {
            rejected(Rejection::NeverFits { prompt: req.prompt_tokens as usize, max_tokens: req.max_tokens as usize, needed, capacity })
        }
        Err(ReserveError::NoRoom { .. }) => rejected(Rejection::pool_busy(waited.elapsed())),
        Err(ReserveError::TooMany { open, limit }) => {
            role.engine.metrics.rejected.with_label_values(&["pool_busy"]).inc();
            ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "server_overloaded",
                code: kvgate_proto::codes::ErrorCode::TooManyReservations,
                param: None,
                message: format!("decode holds {open} open reservations, its limit (--max-open-reservations) is {limit}; nothing was reserved. Retry later."),
            }
            .into_response()
        }
    }
}

async fn cancel(State(role): State<DecodeRole>, Path(id): Path<String>, body: Bytes) -> Response {
    let result = async {
        let id = parse_id(&id)?;
        let req: CancelRequest = api::parse(&body)?;
        role.reservations.cancel(id, req.rejected).map_err(|v| verdict_error(&v))?;
        Ok::<_, ApiError>(Json(serde_json::json!({ "cancelled": true })).into_response())
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// Streams tokens as newline-delimited JSON once the handoff is committed; a failed handoff
/// answers 502 before a single token exists.
async fn generate(State(role): State<DecodeRole>, Path(id): Path<String>, body: Bytes) -> Response {
    let span = tracing::info_span!(
        "decode",
        otel.kind = "server",
        otel.status_code = Empty,
        otel.status_description = Empty, error.type = Empty,
        trace_id = Empty,
        span_id = Empty,
        handoff_id = %id,
        tenant = Empty,
        completion_tokens = Empty,
    );
    // Joined before the span is first entered: entering starts it, and a started span keeps
    // the parent it started with.
    let parsed: Result<GenerateRequest, ApiError> = api::parse(&body);
    super::join_trace(&span, parsed.as_ref().ok().and_then(|r| r.traceparent.as_deref()));
    if let Ok(r) = &parsed {
        span.record("tenant", r.tenant.as_str());
    }
    let result = async {
        let id = parse_id(&id)?;
        let req = parsed?;
        let wait = req.commit_wait_ms.map(Duration::from_millis);
        let committed = role.reservations.take_committed(id, wait, &req.tenant).await.map_err(|v| {
            mark_failed(&tracing::Span::current(), v.reason.as_str());
            verdict_error(&v)
        })?;
        // The reservation, not the caller, bounds what is generated (its pages are the lease).
        if committed.reserved_tokens as usize != req.prompt.len() {
            return Err(ApiError::invalid("prompt", format!("prompt has {} tokens, the handoff carried {}", req.prompt.len(), committed.reserved_tokens)));
        }
        if req.max_tokens == 0 || req.max_tokens > committed.max_tokens {
            return Err(ApiError::invalid(
                "max_tokens",
                format!("`max_tokens` must be between 1 and the {} reserved, got {}", committed.max_tokens, req.max_tokens),
            ));
        }
        let sampling = SamplingParams::from(req.sampling);
        let mode = Mode::Continue { lease: committed.lease, first_token: committed.first_token, first_logprobs: committed.first_logprobs };
        let rx = role.engine.enqueue(req.prompt, req.max_tokens as usize, sampling, mode, req.tenant.as_str());
        // The span lives as long as the stream: generation is part of the call.
        let span = tracing::Span::current();
        let lines = UnboundedReceiverStream::new(rx).map(move |event| {
            let line = match event {
                Event::Token(token, None) => StreamLine::Token(token),
                Event::Token(token, Some(logprobs)) => StreamLine::Scored { token, logprobs },
                // Prompt log-probabilities come from prefill, through the router.
                Event::PromptLogprobs(_) => return Ok(String::new()),
                Event::Done { finish, prompt_tokens, completion_tokens } => {
                    span.record("completion_tokens", completion_tokens as i64);
                    StreamLine::Done { finish, prompt_tokens: prompt_tokens as u32, completion_tokens: completion_tokens as u32 }
                }
                Event::Rejected(r) => StreamLine::Error { status: ApiError::from(r.clone()).status.as_u16(), code: r.code(), message: r.to_string() },
                Event::Failed(f) => StreamLine::Error { status: f.status, code: f.code, message: f.message },
            };
            let mut text = serde_json::to_string(&line).unwrap();
            text.push('\n');
            Ok::<_, std::convert::Infallible>(text)
        });
        Ok(Response::builder().header("content-type", "application/x-ndjson").body(Body::from_stream(lines)).unwrap())
    }
    .instrument(span)
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}
