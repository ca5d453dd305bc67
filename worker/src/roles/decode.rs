//! The decode role: reserves pages, receives KV on its KV port, and generates only from a
//! handoff whose every check passed.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use futures::StreamExt;
use kvgate_proto::handoff::HandoffId;
use kvgate_proto::roles::{CancelRequest, GenerateRequest, ReserveRequest, Reservation, StreamLine};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::engine::{Engine, Event, Mode, Rejection};
use crate::handoff::auth::to_hex;
use crate::handoff::reservations::ReserveError;
use crate::handoff::{Reservations, Verdict};
use crate::model::SamplingParams;
use crate::server::api;
use crate::server::error::ApiError;

#[derive(Clone)]
pub struct DecodeRole {
    pub engine: Engine,
    pub reservations: Arc<Reservations>,
    pub kv_addr: String,
}

pub fn routes(role: DecodeRole) -> Router {
    Router::new()
        .route(super::RESERVE_PATH, post(reserve))
        .route("/internal/v1/handoffs/{id}/cancel", post(cancel))
        .route("/internal/v1/handoffs/{id}/generate", post(generate))
        .with_state(role)
}

/// The error a failed handoff surfaces as: 502, with decode's own words.
pub fn verdict_error(v: &Verdict) -> ApiError {
    ApiError { status: StatusCode::BAD_GATEWAY, kind: "server_error", code: format!("kv_handoff_{}", v.reason), param: None, message: v.message.clone() }
}

fn parse_id(id: &str) -> Result<HandoffId, ApiError> {
    id.parse().map_err(|e: String| ApiError::invalid("handoff_id", e))
}

async fn reserve(State(role): State<DecodeRole>, body: Bytes) -> Response {
    let req: ReserveRequest = match api::parse(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let report_model = role.engine.model.fingerprint.clone();
    let layout = role.engine.pool.layout().fingerprint();
    match role.reservations.reserve(req.prompt_tokens, req.max_tokens) {
        Ok(issued) => Json(Reservation {
            handoff_id: issued.id.to_string(),
            pages: issued.pages,
            reserved_tokens: issued.reserved_tokens,
            expires_ms: issued.expires_ms,
            tag: to_hex(&issued.tag),
            kv_addr: role.kv_addr.clone(),
            model_fingerprint: report_model,
            layout_fingerprint: layout,
        })
        .into_response(),
        Err(ReserveError::NeverFits { needed, capacity }) => {
            let r = Rejection::NeverFits { prompt: req.prompt_tokens as usize, max_tokens: req.max_tokens as usize, needed, capacity };
            role.engine.metrics.rejected.with_label_values(&[r.reason()]).inc();
            ApiError::from(r).into_response()
        }
        Err(ReserveError::NoRoom { needed, free }) => {
            role.engine.metrics.rejected.with_label_values(&["pool_busy"]).inc();
            ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "server_overloaded",
                code: "pool_busy".into(),
                param: None,
                message: format!("The decode KV pool has {free} free tokens, {needed} needed; nothing was reserved. Retry later."),
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
    let result = async {
        let id = parse_id(&id)?;
        let req: GenerateRequest = api::parse(&body)?;
        let wait = req.commit_wait_ms.map(std::time::Duration::from_millis);
        let committed = role.reservations.take_committed(id, wait).await.map_err(|v| verdict_error(&v))?;
        if committed.reserved_tokens as usize != req.prompt.len() {
            return Err(ApiError::invalid("prompt", format!("prompt has {} tokens, the handoff carried {}", req.prompt.len(), committed.reserved_tokens)));
        }
        let sampling = SamplingParams { temperature: req.sampling.temperature, top_p: req.sampling.top_p, seed: req.sampling.seed };
        let mode = Mode::Continue { lease: committed.lease, first_token: committed.first_token };
        let rx = role.engine.enqueue(req.prompt, req.max_tokens as usize, sampling, mode);
        let lines = UnboundedReceiverStream::new(rx).map(|event| {
            let line = match event {
                Event::Token(t) => StreamLine::Token(t),
                Event::Done { finish, prompt_tokens, completion_tokens } => StreamLine::Done {
                    finish: finish.as_str().into(),
                    prompt_tokens: prompt_tokens as u32,
                    completion_tokens: completion_tokens as u32,
                },
                Event::Rejected(r) => StreamLine::Error { status: ApiError::from(r.clone()).status.as_u16(), code: r.reason().into(), message: r.to_string() },
                Event::Failed(f) => StreamLine::Error { status: f.status, code: f.code, message: f.message },
            };
            let mut text = serde_json::to_string(&line).unwrap();
            text.push('\n');
            Ok::<_, std::convert::Infallible>(text)
        });
        Ok(Response::builder().header("content-type", "application/x-ndjson").body(Body::from_stream(lines)).unwrap())
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}
