//! The shared core of `/v1/completions` and `/v1/chat/completions`: submit, wait for the first
//! event (so a rejection still gets its own status code), then answer whole or as SSE.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::AppState;
use super::api::PromptInput;
use super::error::ApiError;
use crate::engine::{Event, FinishReason};
use crate::model::SamplingParams;
use crate::tokenizer::StreamDecoder;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// What one generation needs once the body is parsed.
#[derive(Debug)]
pub struct Job {
    pub endpoint: Endpoint,
    pub prompt: PromptInput,
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stream: bool,
}

pub async fn run(state: &AppState, job: Job) -> Result<Response, ApiError> {
    let tokenizer = &state.tokenizer;
    let tokens = match job.prompt {
        PromptInput::Text(text) => tokenizer.encode(&text).map_err(|e| ApiError::invalid("prompt", e.to_string()))?,
        PromptInput::Tokens(ids) => {
            if let (Some(vocab), Some(at)) = (state.vocab, ids.iter().position(|t| state.vocab.is_some_and(|v| *t as usize >= v))) {
                return Err(ApiError::invalid("prompt", format!("`prompt[{at}]` = {} is outside the vocabulary of {vocab} tokens", ids[at])));
            }
            ids
        }
    };
    let max_tokens = job.max_tokens.unwrap_or_else(|| default_max_tokens(job.endpoint, state.window, tokens.len()));
    let mut rx = state.backend.submit(tokens, max_tokens, job.sampling).map_err(|r| state.rejected(r))?;
    let first = match rx.recv().await {
        Some(Event::Rejected(r)) => return Err(state.rejected(r)),
        Some(Event::Failed(f)) => return Err(state.failed(f)),
        Some(e) => e,
        None => return Err(ApiError::internal("engine dropped the request")),
    };
    let meta = Meta { id: new_id(job.endpoint), created: now(), model: state.model_name.clone(), endpoint: job.endpoint };
    if job.stream {
        state.count(200);
        let stream = sse_stream(state.clone(), meta, first, rx);
        return Ok(Sse::new(stream).into_response());
    }
    let mut decoder = StreamDecoder::default();
    let mut text = String::new();
    let mut event = Some(first);
    loop {
        match event {
            Some(Event::Token(id)) => text.push_str(&decoder.push(tokenizer, id).map_err(internal)?),
            Some(Event::Done { finish, prompt_tokens, completion_tokens }) => {
                text.push_str(&decoder.finish(tokenizer).map_err(internal)?);
                state.count(200);
                return Ok(Json(meta.whole(&text, finish, prompt_tokens, completion_tokens)).into_response());
            }
            Some(Event::Failed(f)) => return Err(state.failed(f)),
            Some(Event::Rejected(r)) => return Err(state.rejected(r)),
            None => return Err(ApiError::internal("engine dropped the request")),
        }
        event = rx.recv().await;
    }
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::internal(e.to_string())
}

/// Completions default to OpenAI's 16 tokens; chat to as much as the window leaves, up to 256.
fn default_max_tokens(endpoint: Endpoint, window: usize, prompt: usize) -> usize {
    match endpoint {
        Endpoint::Completions => 16,
        Endpoint::Chat => window.saturating_sub(prompt).clamp(1, 256),
    }
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    endpoint: Endpoint,
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({ "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion })
}

impl Meta {
    fn whole(&self, text: &str, finish: FinishReason, prompt: usize, completion: usize) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => json!({ "index": 0, "text": text, "logprobs": null, "finish_reason": finish.as_str() }),
            Endpoint::Chat => json!({
                "index": 0, "message": { "role": "assistant", "content": text }, "logprobs": null,
                "finish_reason": finish.as_str()
            }),
        };
        json!({
            "id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
            "choices": [choice], "usage": usage(prompt, completion)
        })
    }

    fn chunk(&self, text: &str, finish: Option<FinishReason>, usage_value: Option<Value>, first: bool) -> Value {
        let finish = finish.map(FinishReason::as_str);
        let choice = match self.endpoint {
            Endpoint::Completions => json!({ "index": 0, "text": text, "logprobs": null, "finish_reason": finish }),
            Endpoint::Chat => {
                let delta = if first { json!({ "role": "assistant", "content": text }) } else { json!({ "content": text }) };
                json!({ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish })
            }
        };
        let mut v = json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [choice]
        });
        if let Some(u) = usage_value {
            v["usage"] = u;
        }
        v
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }
}

/// SSE chunks: one per decoded piece, a last one with `finish_reason` and `usage`, then
/// `data: [DONE]`. An engine failure mid-stream ends the stream with an error object.
fn sse_stream(state: AppState, meta: Meta, first: Event, rx: UnboundedReceiver<Event>) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    struct S {
        state: AppState,
        meta: Meta,
        pending: Option<Event>,
        rx: UnboundedReceiver<Event>,
        decoder: StreamDecoder,
        first_chunk: bool,
        done: bool,
    }
    let init = S { state, meta, pending: Some(first), rx, decoder: StreamDecoder::default(), first_chunk: true, done: false };
    let batches = futures::stream::unfold(init, |mut s| async move {
        if s.done {
            return None;
        }
        let tok = &s.state.tokenizer;
        loop {
            let event = match s.pending.take() {
                Some(e) => Some(e),
                None => s.rx.recv().await,
            };
            let out: Vec<String> = match event {
                Some(Event::Token(id)) => {
                    let piece = s.decoder.push(tok, id).unwrap_or_default();
                    if piece.is_empty() {
                        continue;
                    }
                    let v = s.meta.chunk(&piece, None, None, s.first_chunk);
                    s.first_chunk = false;
                    vec![v.to_string()]
                }
                Some(Event::Done { finish, prompt_tokens, completion_tokens }) => {
                    s.done = true;
                    let rest = s.decoder.finish(tok).unwrap_or_default();
                    let v = s.meta.chunk(&rest, Some(finish), Some(usage(prompt_tokens, completion_tokens)), s.first_chunk);
                    vec![v.to_string(), "[DONE]".to_string()]
                }
                Some(Event::Failed(f)) => {
                    s.done = true;
                    vec![json!({ "error": { "message": f.message, "type": "server_error", "code": f.code } }).to_string()]
                }
                Some(Event::Rejected(r)) => {
                    s.done = true;
                    vec![json!({ "error": { "message": r.to_string(), "type": "server_error", "code": r.reason() } }).to_string()]
                }
                None => return None,
            };
            return Some((out, s));
        }
    });
    batches.flat_map(|datas| futures::stream::iter(datas.into_iter().map(|d| Ok(SseEvent::default().data(d)))))
}

fn new_id(endpoint: Endpoint) -> String {
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
