//! What flows into and out of the engine for one request.

use std::time::Instant;

use tokio::sync::mpsc;

use super::admission::Rejection;
use crate::model::SamplingParams;

/// A tokenized, admitted request on its way to the scheduler.
#[derive(Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub arrived: Instant,
    pub events: mpsc::UnboundedSender<Event>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// The model produced an end-of-sequence token.
    Stop,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
        }
    }
}

/// What the engine reports for a request, in order: tokens, then exactly one `Done` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token(u32),
    Done { finish: FinishReason, prompt_tokens: usize, completion_tokens: usize },
    Rejected(Rejection),
    Failed(String),
}
