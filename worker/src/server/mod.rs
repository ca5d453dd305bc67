//! The HTTP API: OpenAI-compatible completions, the capacity report, health and metrics.

pub mod api;
mod choice;
pub mod error;
pub mod fairness;
mod fields;
mod generate;
mod identify;
pub mod limits;
pub mod report;
pub mod request_context;
mod shares;
pub mod tokenize;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use kvgate_proto::{CapacityReport, KV_POOL_PATH};
use serde_json::json;

use crate::engine::{Engine, Event, Rejection};
use crate::metrics::Metrics;
use crate::model::SamplingParams;
use crate::tokenizer::Tokenizer;
use api::{ChatRequest, CompletionRequest, PromptInput};
use error::ApiError;
use generate::{Endpoint, Job};
pub use request_context::{Delivery, RequestContext};

/// Generation by other processes (the router role's prefill/decode pairs), as the API sees it.
pub trait Remote: Send + Sync {
    /// Starts generating; `request` names the request to the peers (its trace position).
    fn submit(
        self: Arc<Self>,
        prompt: Vec<u32>,
        max_tokens: usize,
        sampling: SamplingParams,
        request: &RequestContext,
    ) -> Result<tokio::sync::mpsc::UnboundedReceiver<Event>, Rejection>;
    /// Whether a request could be served now (readiness).
    fn can_serve(&self) -> bool;
    /// The capacity reports of the workers behind it.
    fn reports(&self) -> kvgate_proto::PeerReports;
}

/// Who generates the tokens behind the OpenAI API.
#[derive(Clone)]
pub enum Backend {
    /// A model and pool in this process (colocated serving).
    Engine(Engine),
    /// Prefill and decode peers, through the handoff (the router role).
    Remote(Arc<dyn Remote>),
}

impl Backend {
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        max_tokens: usize,
        sampling: SamplingParams,
        request: &RequestContext,
    ) -> Result<tokio::sync::mpsc::UnboundedReceiver<Event>, Rejection> {
        match self {
            Backend::Engine(e) => e.submit(prompt, max_tokens, sampling, &request.tenant.to_string()),
            Backend::Remote(r) => r.clone().submit(prompt, max_tokens, sampling, request),
        }
    }

    /// This process works (liveness): the engine thread runs. A router is alive whether or not
    /// it has peers: restarting it would not give it any.
    fn is_alive(&self) -> bool {
        match self {
            Backend::Engine(e) => e.is_alive(),
            Backend::Remote(_) => true,
        }
    }

    /// Can serve (readiness): the engine runs, or the router knows a usable prefill/decode pair
    /// (so a Service sends no traffic to a router that could only answer 503).
    fn can_serve(&self) -> bool {
        match self {
            Backend::Engine(e) => e.is_alive(),
            Backend::Remote(r) => r.can_serve(),
        }
    }
}

#[derive(Clone)]
pub struct AppState {
    pub backend: Backend,
    pub tokenizer: Arc<Tokenizer>,
    pub model_name: String,
    /// The model's vocabulary (token ids are checked against it before anything else).
    pub vocab: Option<usize>,
    pub special: tokenize::SpecialTokens,
    pub window: usize,
    /// This role's metrics (requests are counted here).
    pub metrics: Metrics,
    /// The measured pool, for roles that have one.
    pub report: Option<Arc<CapacityReport>>,
    /// Signs the report for whoever asks with a nonce (prefill and decode of a deployment).
    pub report_signer: Option<report::ReportSigner>,
    pub ready: Arc<AtomicBool>,
    pub registry: prometheus::Registry,
    /// Requests in flight per tenant (public routes with a body).
    pub in_flight: Arc<fairness::InFlight>,
    /// Who may call the public API and how much each tenant may use.
    pub tenants: Arc<crate::tenants::Tenants>,
}

impl AppState {
    /// State for a process that serves its own engine.
    pub fn for_engine(engine: Engine, report: CapacityReport, registry: prometheus::Registry, serve: &crate::cli::ServeArgs) -> Self {
        AppState {
            tokenizer: engine.tokenizer(),
            model_name: engine.model.name.clone(),
            vocab: Some(engine.model.vocab_size()),
            special: tokenize::SpecialTokens::of(&engine.model.tokenizer, engine.model.llama.config().bos_token_id, &engine.model.eos),
            window: engine.limits().window,
            metrics: engine.metrics.clone(),
            backend: Backend::Engine(engine),
            report: Some(Arc::new(report)),
            report_signer: None,
            ready: Arc::new(AtomicBool::new(true)),
            registry,
            in_flight: fairness::in_flight(serve.max_requests_per_client as usize),
            // Prefill and decode serve no public API; a colocated engine gets its tenants with
            // `with_tenants`.
            tenants: crate::tenants::Tenants::open(&prometheus::Registry::new(), "none"),
        }
    }

    pub fn with_tenants(self, tenants: Arc<crate::tenants::Tenants>) -> Self {
        AppState { tenants, ..self }
    }

    /// Reports asked for with a nonce are signed with `secret` and this pod's name.
    pub fn signed_by(self, secret: &crate::handoff::auth::Secret, engine: &crate::cli::EngineArgs) -> Self {
        let signer = report::ReportSigner { secret: secret.clone(), pod: engine.pod_name.clone().unwrap_or_default() };
        AppState { report_signer: Some(signer), ..self }
    }

    pub(crate) fn count(&self, code: u16) {
        self.metrics.requests.with_label_values(&[&code.to_string()]).inc();
    }

    /// Counts a rejection and turns it into its response.
    fn rejected(&self, r: Rejection) -> ApiError {
        self.metrics.rejected.with_label_values(&[r.reason()]).inc();
        ApiError::from(r)
    }
}

/// The OpenAI-compatible API plus the operational endpoints. A request with a body gets its id
/// and trace position (`request_context`), is given its tenant or a 401 (`tenants::identify`),
/// takes one of its tenant's places (`fairness`, 429 past the share), and only then is its body
/// read:
/// as large as a prompt of the whole window needs (`limits::public_body`; larger ones get a
/// JSON 413), within its deadline (408).
pub fn app(state: AppState) -> Router {
    let body_limit = limits::public_body(state.window);
    let with_body = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .layer(axum::middleware::from_fn_with_state(state.clone(), limits::read_public_body))
        .layer(axum::middleware::from_fn_with_state(state.clone(), fairness::limit))
        .layer(axum::middleware::from_fn_with_state(state.clone(), identify::identify))
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::from_fn(request_context::open));
    let listing = Router::new()
        .route("/v1/models", get(models))
        .route("/tokenizer_info", get(tokenize::tokenizer_info))
        .layer(axum::middleware::from_fn_with_state(state.clone(), identify::identify));
    Router::new().merge(with_body).merge(listing).merge(ops(state.clone())).with_state(state)
}

/// Capacity report, health and metrics only (prefill and decode roles).
pub fn ops<S>(state: AppState) -> Router<S> {
    Router::new()
        .route(KV_POOL_PATH, get(report::kv_pool))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

pub fn local_addr(listener: &tokio::net::TcpListener) -> SocketAddr {
    listener.local_addr().expect("bound listener has an address")
}

fn check_model(state: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if *m != state.model_name => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            code: kvgate_proto::codes::ErrorCode::ModelNotFound,
            param: Some("model".into()),
            message: format!("The model `{m}` does not exist; this worker serves `{}`.", state.model_name),
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

/// The body, or the OpenAI-shaped error for one over the limit (or unreadable).
fn body_or_error(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::body_too_large(limits::public_body(state.window)),
        _ => ApiError::invalid("body", format!("reading the request body: {e}")),
    })
}

async fn completions(State(state): State<AppState>, Extension(request): Extension<RequestContext>, body: Result<Bytes, BytesRejection>) -> Response {
    let result = async {
        let body = body_or_error(&state, body)?;
        fields::check(&body, false)?;
        let req: CompletionRequest = api::parse(&body)?;
        check_model(&state, &req.model)?;
        if req.return_token_ids && req.common.stream {
            // As for a field the API does not implement: never let a client believe it applied.
            return Err(ApiError::invalid("return_token_ids", "`return_token_ids` is answered on whole answers only, not with `stream`: leave one out"));
        }
        let logprobs = req.logprobs.map(|k| api::check_top_logprobs("logprobs", k)).transpose()?;
        let sampling = SamplingParams { logprobs, prompt_logprobs: req.echo && logprobs.is_some(), ..req.common.sampling()? };
        let job = Job {
            endpoint: Endpoint::Completions,
            prompt: req.prompt_input()?,
            max_tokens: req.max_tokens.map(|v| api::check_max_tokens("max_tokens", v)).transpose()?,
            sampling,
            stream: req.common.stream,
            include_usage: req.common.include_usage(),
            choices: req.common.choices()?,
            stop: req.common.stops()?,
            echo: req.echo,
            return_token_ids: req.return_token_ids,
            request,
        };
        generate::run(&state, job).await
    }
    .await;
    respond(&state, result).await
}

async fn chat(State(state): State<AppState>, Extension(request): Extension<RequestContext>, body: Result<Bytes, BytesRejection>) -> Response {
    let result = async {
        let body = body_or_error(&state, body)?;
        fields::check(&body, true)?;
        let req: ChatRequest = api::parse(&body)?;
        check_model(&state, &req.model)?;
        let max_tokens = match (req.max_completion_tokens, req.max_tokens) {
            (Some(v), _) => Some(api::check_max_tokens("max_completion_tokens", v)?),
            (None, Some(v)) => Some(api::check_max_tokens("max_tokens", v)?),
            (None, None) => None,
        };
        let job = Job {
            endpoint: Endpoint::Chat,
            prompt: PromptInput::Text(req.render()?),
            max_tokens,
            sampling: SamplingParams { logprobs: req.logprobs()?, ..req.common.sampling()? },
            stream: req.common.stream,
            include_usage: req.common.include_usage(),
            choices: req.common.choices()?,
            stop: req.common.stops()?,
            echo: false,
            return_token_ids: false,
            request,
        };
        generate::run(&state, job).await
    }
    .await;
    respond(&state, result).await
}

async fn models(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_name, "object": "model", "created": 0, "owned_by": "kvgate",
            "max_model_len": state.window
        }]
    }))
}

async fn healthz(State(state): State<AppState>) -> Response {
    if state.backend.is_alive() {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "engine thread stopped\n").into_response()
    }
}

async fn readyz(State(state): State<AppState>) -> Response {
    if state.ready.load(Ordering::SeqCst) && state.backend.can_serve() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response()
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], crate::metrics::render(&state.registry)).into_response()
}

impl AppState {
    /// Token ids a client sent must be ids of the model: a 400 naming the first that is not.
    fn check_vocab(&self, field: &str, ids: &[u32]) -> Result<(), ApiError> {
        match (self.vocab, ids.iter().position(|t| self.vocab.is_some_and(|v| *t as usize >= v))) {
            (Some(vocab), Some(at)) => Err(ApiError::invalid(field, format!("`{field}[{at}]` = {} is outside the vocabulary of {vocab} tokens", ids[at]))),
            _ => Ok(()),
        }
    }

    /// A failure after admission; one that is really a peer's rejection is counted as one.
    fn failed(&self, f: crate::engine::Failure) -> ApiError {
        if let Some(reason) = Rejection::reason_of(f.code) {
            self.metrics.rejected.with_label_values(&[reason]).inc();
        }
        ApiError::from(f)
    }
}
