//! The HTTP API: OpenAI-compatible completions, the capacity report, health and metrics.

pub mod api;
pub mod error;
mod generate;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvgate_proto::{CapacityReport, KV_POOL_PATH};
use serde_json::json;

use crate::engine::{Engine, Rejection};
use api::{ChatRequest, CompletionRequest};
use error::ApiError;
use generate::{Endpoint, Job};

#[derive(Clone)]
pub struct AppState {
    pub engine: Engine,
    pub report: Arc<CapacityReport>,
    pub ready: Arc<AtomicBool>,
    pub registry: prometheus::Registry,
}

impl AppState {
    fn count(&self, code: u16) {
        self.engine.metrics.requests.with_label_values(&[&code.to_string()]).inc();
    }

    /// Counts a rejection and turns it into its response.
    fn rejected(&self, r: Rejection) -> ApiError {
        self.engine.metrics.rejected.with_label_values(&[r.reason()]).inc();
        ApiError::from(r)
    }
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route(KV_POOL_PATH, get(kv_pool))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// Serves until `shutdown` resolves, then drains in-flight requests.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let ready = state.ready.clone();
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async move {
            shutdown.await;
            ready.store(false, Ordering::SeqCst);
        })
        .await
}

pub fn local_addr(listener: &tokio::net::TcpListener) -> SocketAddr {
    listener.local_addr().expect("bound listener has an address")
}

fn check_model(state: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if *m != state.engine.model.name => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            code: "model_not_found".into(),
            param: Some("model".into()),
            message: format!("The model `{m}` does not exist; this worker serves `{}`.", state.engine.model.name),
        }),
        _ => Ok(()),
    }
}

/// Answers with `result`, counting errors by status code (successes are counted where the
/// response is built).
async fn respond(state: &AppState, result: Result<Response, ApiError>) -> Response {
    match result {
        Ok(r) => r,
        Err(e) => {
            state.count(e.status.as_u16());
            e.into_response()
        }
    }
}

async fn completions(State(state): State<AppState>, body: Bytes) -> Response {
    let result = async {
        let req: CompletionRequest = api::parse(&body)?;
        check_model(&state, &req.model)?;
        let job = Job {
            endpoint: Endpoint::Completions,
            prompt: req.prompt_text()?.to_string(),
            max_tokens: req.max_tokens.map(|v| api::check_max_tokens("max_tokens", v)).transpose()?,
            sampling: req.common.sampling()?,
            stream: req.common.stream,
        };
        generate::run(&state, job).await
    }
    .await;
    respond(&state, result).await
}

async fn chat(State(state): State<AppState>, body: Bytes) -> Response {
    let result = async {
        let req: ChatRequest = api::parse(&body)?;
        check_model(&state, &req.model)?;
        let max_tokens = match (req.max_completion_tokens, req.max_tokens) {
            (Some(v), _) => Some(api::check_max_tokens("max_completion_tokens", v)?),
            (None, Some(v)) => Some(api::check_max_tokens("max_tokens", v)?),
            (None, None) => None,
        };
        let job = Job { endpoint: Endpoint::Chat, prompt: req.render()?, max_tokens, sampling: req.common.sampling()?, stream: req.common.stream };
        generate::run(&state, job).await
    }
    .await;
    respond(&state, result).await
}

async fn models(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.engine.model.name, "object": "model", "created": 0, "owned_by": "kvgate",
            "max_model_len": state.engine.limits().window
        }]
    }))
}

async fn kv_pool(State(state): State<AppState>) -> Json<CapacityReport> {
    Json((*state.report).clone())
}

async fn healthz(State(state): State<AppState>) -> Response {
    if state.engine.is_alive() {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "engine thread stopped\n").into_response()
    }
}

async fn readyz(State(state): State<AppState>) -> Response {
    if state.ready.load(Ordering::SeqCst) && state.engine.is_alive() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response()
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], crate::metrics::render(&state.registry)).into_response()
}
