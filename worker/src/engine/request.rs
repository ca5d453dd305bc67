//! What flows into and out of the engine for one request.

use kvgate_proto::codes::ErrorCode;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};

use super::admission::Rejection;
use kvgate_proto::logprobs::TokenLogprobs;

use crate::kv::Lease;
use crate::model::SamplingParams;

/// What the engine does with a request.
#[derive(Debug)]
pub enum Mode {
    /// Prefill and decode here (colocated serving).
    Full,
    /// Prefill only: compute the prompt's KV into a fresh lease, sample the first token, and hand
    /// both back instead of decoding (the prefill role of a handoff).
    PrefillOnly { reply: oneshot::Sender<Prefilled> },
    /// The prompt's KV already sits in `lease` (a verified handoff): continue after `first_token`.
    Continue { lease: Lease, first_token: u32, first_logprobs: Option<TokenLogprobs> },
}

/// The result of a prefill-only request.
#[derive(Debug)]
pub struct Prefilled {
    pub lease: Lease,
    pub first_token: u32,
    pub first_logprobs: Option<TokenLogprobs>,
    /// One per prompt token (none for the first), when asked for.
    pub prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
}

/// A tokenized, admitted request on its way to the scheduler.
#[derive(Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub arrived: Instant,
    pub events: mpsc::UnboundedSender<Event>,
    pub mode: Mode,
    /// Whose request it is: the scheduler shares compute between tenants with work.
    pub tenant: std::sync::Arc<str>,
    /// The span it was submitted under (the engine thread's spans of its prompt chunks hang
    /// under it).
    pub span: tracing::Span,
}

pub use kvgate_proto::roles::FinishReason;

/// What the engine reports for a request, in order: the prompt's log-probabilities (when asked
/// for), tokens (with theirs, when asked for), then exactly one `Done` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    PromptLogprobs(Vec<Option<TokenLogprobs>>),
    Token(u32, Option<TokenLogprobs>),
    Done { finish: FinishReason, prompt_tokens: usize, completion_tokens: usize },
    Rejected(Rejection),
    Failed(Failure),
}

/// A request that failed after admission, with the HTTP status and code it should surface as.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub status: u16,
    pub code: ErrorCode,
    pub message: String,
}

impl Failure {
    pub fn internal(message: impl Into<String>) -> Self {
        Failure { status: 500, code: ErrorCode::InternalError, message: message.into() }
    }
}
