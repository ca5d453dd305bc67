//! The shared core of `/v1/completions` and `/v1/chat/completions`: submit every choice, wait
//! for each one's first event (so a rejection still gets its own status code), then answer
//! whole or as SSE. Stop strings, `echo` and log-probabilities are applied here, per choice.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use kvgate_proto::logprobs::TokenLogprobs;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::api::PromptInput;
use super::choice::{Choice, Scored};
use super::error::ApiError;
use super::limits;
use super::{AppState, RequestContext};
use crate::engine::{Event, FinishReason};
use crate::model::SamplingParams;
use crate::tenants::Tenant;
use crate::tokenizer::{self, Tokenizer};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// What one request needs once the body is parsed.
#[derive(Debug)]
pub struct Job {
    pub endpoint: Endpoint,
    pub prompt: PromptInput,
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
    /// `n`: each choice is generated on its own (from `seed + i` when seeded).
    pub choices: usize,
    pub stop: Vec<String>,
    /// Completions only: the prompt goes in front of each choice's text.
    pub echo: bool,
    /// Completions only: a whole answer's choices carry the ids they generated.
    pub return_token_ids: bool,
    /// Its identity, tenant included (charged for the prompt and every generated token).
    pub request: RequestContext,
}

/// One choice being generated: its first event (already received) and the rest.
type Pending = (Event, UnboundedReceiver<Event>);

pub async fn run(state: &AppState, job: Job) -> Result<Response, ApiError> {
    let tokenizer = &state.tokenizer;
    let (tokens, prompt_text) = match &job.prompt {
        PromptInput::Text(text) => {
            let ids = tokenizer::encode_off_runtime(tokenizer, text.clone(), true).await.map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
            (ids, text.clone())
        }
        PromptInput::Tokens(ids) => {
            state.check_vocab("prompt", ids)?;
            (ids.clone(), if job.echo { tokenizer::decode_off_runtime(tokenizer, ids.clone()).await.map_err(internal)? } else { String::new() })
        }
    };
    let prompt_tokens = tokens.len();
    let max_tokens = job.max_tokens.unwrap_or_else(|| default_max_tokens(job.endpoint, state.window, tokens.len()));
    // The request's span (opened by `request_context`), after the GenAI conventions.
    let span = tracing::Span::current();
    span.record("gen_ai.operation.name", if job.endpoint == Endpoint::Chat { "chat" } else { "text_completion" });
    span.record("gen_ai.request.model", state.model_name.as_str());
    span.record("gen_ai.request.max_tokens", max_tokens as i64);
    span.record("gen_ai.usage.input_tokens", prompt_tokens as i64);
    let shape = limits::ResponseShape { choices: job.choices, prompt_tokens, max_tokens, echo: job.echo, logprobs: job.sampling.logprobs };
    shape.check()?;
    let tenants = &state.tenants;
    let prompt_charge = (prompt_tokens * job.choices) as u64;
    if let Err(over) = tenants.quota.admit(&job.request.tenant, prompt_charge) {
        tenants.metrics.refused(Some(&job.request.tenant), "token_quota");
        return Err(ApiError::from(&over));
    }
    tenants.metrics.tokens(&job.request.tenant, "prompt", prompt_charge);
    let mut pending: Vec<Pending> = Vec::with_capacity(job.choices);
    let delivery = if job.stream { super::Delivery::Streamed } else { super::Delivery::Held };
    let request = super::RequestContext { delivery, ..job.request.clone() };
    for i in 0..job.choices {
        let sampling = SamplingParams { seed: job.sampling.seed.map(|s| s.wrapping_add(i as u64)), ..job.sampling };
        let mut rx = state.backend.submit(tokens.clone(), max_tokens, sampling, &request).map_err(|r| state.rejected(r))?;
        let first = match rx.recv().await {
            Some(Event::Rejected(r)) => return Err(state.rejected(r)),
            Some(Event::Failed(f)) => return Err(state.failed(f)),
            Some(e) => e,
            None => return Err(ApiError::internal("engine dropped the request")),
        };
        if i == 0 {
            span.record("gen_ai.server.time_to_first_token", job.request.started.elapsed().as_secs_f64());
        }
        pending.push((first, rx));
    }
    let meta = Arc::new(Meta {
        id: new_id(job.endpoint),
        created: now(),
        model: state.model_name.clone(),
        endpoint: job.endpoint,
        echo: job.echo.then_some(Echo { text: prompt_text, tokens }),
        prompt_tokens,
        logprobs: job.sampling.logprobs.is_some(),
        return_token_ids: job.return_token_ids,
        include_usage: job.include_usage,
        choices: job.choices,
        streamed: AtomicUsize::new(0),
        span,
        tenant: job.request.tenant.clone(),
    });
    state.count(200);
    if job.stream {
        let streams = pending.into_iter().enumerate().map(|(i, p)| choice_stream(state.clone(), meta.clone(), job.stop.clone(), i, p).boxed());
        let chunks = futures::stream::select_all(streams);
        let tail = usage_tail(meta.clone());
        return Ok(Sse::new(chunks.chain(tail)).into_response());
    }
    let mut choices = Vec::with_capacity(pending.len());
    for (first, rx) in pending {
        choices.push(collect(state, &job.request.tenant, job.stop.clone(), first, rx).await?);
    }
    Ok(Json(meta.whole(tokenizer, &choices)).into_response())
}

/// A choice and the prompt's log-probabilities that came with it.
struct Outcome {
    choice: Choice,
    prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
}

/// Reads one choice to its end: the engine's `Done`, or a stop string (the receiver is dropped,
/// which ends the generation).
async fn collect(state: &AppState, tenant: &Tenant, stops: Vec<String>, first: Event, mut rx: UnboundedReceiver<Event>) -> Result<Outcome, ApiError> {
    let tok = &state.tokenizer;
    let mut out = Outcome { choice: Choice::new(stops), prompt_logprobs: None };
    let mut event = Some(first);
    loop {
        match event {
            Some(Event::PromptLogprobs(p)) => out.prompt_logprobs = Some(p),
            Some(Event::Token(id, logprobs)) => {
                state.tenants.generated(tenant, 1);
                if out.choice.push(tok, id, logprobs).map_err(internal)? {
                    return Ok(out);
                }
            }
            Some(Event::Done { finish, .. }) => {
                out.choice.end(tok, finish).map_err(internal)?;
                return Ok(out);
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

/// The prompt, as `echo` puts it in front of each choice.
struct Echo {
    text: String,
    tokens: Vec<u32>,
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    endpoint: Endpoint,
    echo: Option<Echo>,
    prompt_tokens: usize,
    logprobs: bool,
    return_token_ids: bool,
    include_usage: bool,
    choices: usize,
    /// Completion tokens of the choices a stream has finished (for its closing usage).
    streamed: AtomicUsize,
    /// The request's span: a streamed answer keeps it open until its last chunk.
    span: tracing::Span,
    tenant: Tenant,
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({ "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion })
}

fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id]).unwrap_or_default()
}

impl Meta {
    fn whole(&self, tok: &Tokenizer, outcomes: &[Outcome]) -> Value {
        let choices: Vec<Value> = outcomes
            .iter()
            .enumerate()
            .map(|(index, o)| {
                let c = &o.choice;
                let finish = c.finish.map(FinishReason::as_str);
                match self.endpoint {
                    Endpoint::Completions => {
                        let prefix = self.echo.as_ref().map_or("", |e| e.text.as_str());
                        let prompt = self.echo.as_ref().map(|e| (e, o.prompt_logprobs.as_deref()));
                        let logprobs = self.completion_logprobs(tok, prompt, &c.tokens);
                        let mut choice = json!({ "index": index, "text": format!("{prefix}{}", c.text), "logprobs": logprobs, "finish_reason": finish });
                        if self.return_token_ids {
                            choice["token_ids"] = c.tokens.iter().map(|t| t.id).collect();
                        }
                        choice
                    }
                    Endpoint::Chat => json!({
                        "index": index, "message": { "role": "assistant", "content": c.text },
                        "logprobs": self.chat_logprobs(tok, &c.tokens), "finish_reason": finish
                    }),
                }
            })
            .collect();
        let completion: usize = outcomes.iter().map(|o| o.choice.generated).sum();
        self.finished(completion, outcomes.iter().filter_map(|o| o.choice.finish));
        json!({
            "id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
            "choices": choices, "usage": usage(self.prompt_tokens, completion)
        })
    }

    /// Records what was generated on the request's span.
    fn finished(&self, completion: usize, reasons: impl Iterator<Item = FinishReason>) {
        self.span.record("gen_ai.usage.output_tokens", completion as i64);
        let reasons: Vec<&str> = reasons.map(FinishReason::as_str).collect();
        self.span.record("gen_ai.response.finish_reasons", format!("{reasons:?}"));
    }

    /// OpenAI's completions `logprobs`: parallel lists over the echoed prompt (when `echo`) and
    /// the generated tokens; `text_offset` counts bytes of the answer's text.
    fn completion_logprobs(&self, tok: &Tokenizer, prompt: Option<(&Echo, Option<&[Option<TokenLogprobs>]>)>, tokens: &[Scored]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let (mut texts, mut scores, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
        let mut push = |text: String, lp: Option<&TokenLogprobs>, offset: usize| {
            texts.push(text);
            scores.push(lp.map_or(Value::Null, |l| json!(l.logprob)));
            tops.push(lp.map_or(Value::Null, |l| Value::Object(l.top.iter().map(|(id, p)| (token_text(tok, *id), json!(p))).collect::<Map<_, _>>())));
            offsets.push(offset);
        };
        if let Some((echo, lps)) = prompt {
            let mut offset = 0;
            for (j, id) in echo.tokens.iter().enumerate() {
                let text = token_text(tok, *id);
                let lp = lps.and_then(|p| p.get(j)).and_then(Option::as_ref);
                let len = text.len();
                push(text, lp, offset);
                offset += len;
            }
        }
        // Offsets are into the answer's whole text, which `echo` starts with the prompt.
        let base = self.echo.as_ref().map_or(0, |e| e.text.len());
        for t in tokens {
            push(token_text(tok, t.id), t.logprobs.as_ref(), base + t.offset);
        }
        json!({ "tokens": texts, "token_logprobs": scores, "top_logprobs": tops, "text_offset": offsets })
    }

    /// OpenAI's chat `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
    fn chat_logprobs(&self, tok: &Tokenizer, tokens: &[Scored]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let entry = |id: u32, logprob: f32| {
            let text = token_text(tok, id);
            json!({ "token": text, "logprob": logprob, "bytes": text.as_bytes() })
        };
        let content: Vec<Value> = tokens
            .iter()
            .filter_map(|t| t.logprobs.as_ref().map(|l| (t.id, l)))
            .map(|(id, l)| {
                let mut e = entry(id, l.logprob);
                e["top_logprobs"] = l.top.iter().map(|(id, p)| entry(*id, *p)).collect();
                e
            })
            .collect();
        json!({ "content": content })
    }

    fn chunk(&self, tok: &Tokenizer, index: usize, text: &str, tokens: &[Scored], finish: Option<FinishReason>, first: bool) -> Value {
        let finish = finish.map(FinishReason::as_str);
        let choice = match self.endpoint {
            Endpoint::Completions => {
                let logprobs = self.completion_logprobs(tok, None, tokens);
                json!({ "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish })
            }
            Endpoint::Chat => {
                let delta = if first { json!({ "role": "assistant", "content": text }) } else { json!({ "content": text }) };
                json!({ "index": index, "delta": delta, "logprobs": self.chat_logprobs(tok, tokens), "finish_reason": finish })
            }
        };
        json!({ "id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [choice] })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }
}

/// SSE chunks of one choice: one per piece of text that can be sent (held back while it may
/// still begin a stop string), a last one with `finish_reason` (and `usage` when it is the only
/// choice). An engine failure mid-stream ends the stream with an error object.
fn choice_stream(state: AppState, meta: Arc<Meta>, stops: Vec<String>, index: usize, (first, rx): Pending) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    struct S {
        state: AppState,
        meta: Arc<Meta>,
        pending: Option<Event>,
        rx: Option<UnboundedReceiver<Event>>,
        choice: Choice,
        index: usize,
        first_chunk: bool,
        echoed: bool,
    }
    let init = S { state, meta, pending: Some(first), rx: Some(rx), choice: Choice::new(stops), index, first_chunk: true, echoed: false };
    let batches = futures::stream::unfold(init, |mut s| async move {
        let mut rx = s.rx.take()?;
        let tok = s.state.tokenizer.clone();
        loop {
            let event = match s.pending.take() {
                Some(e) => Some(e),
                None => rx.recv().await,
            };
            let mut out = Vec::new();
            // `echo` sends the prompt (and its log-probabilities) as the first chunk.
            if !s.echoed {
                s.echoed = true;
                if let Some(echo) = &s.meta.echo {
                    let mut v = s.meta.chunk(&tok, s.index, &echo.text, &[], None, true);
                    let lps = match &event {
                        Some(Event::PromptLogprobs(p)) => Some(p.as_slice()),
                        _ => None,
                    };
                    v["choices"][0]["logprobs"] = s.meta.completion_logprobs(&tok, Some((echo, lps)), &[]);
                    out.push(v.to_string());
                    s.first_chunk = false;
                }
            }
            let ended = match event {
                Some(Event::PromptLogprobs(_)) => false,
                Some(Event::Token(id, logprobs)) => {
                    s.state.tenants.generated(&s.meta.tenant, 1);
                    s.choice.push(&tok, id, logprobs).unwrap_or(false)
                }
                Some(Event::Done { finish, .. }) => {
                    let _ = s.choice.end(&tok, finish);
                    true
                }
                Some(Event::Failed(f)) => {
                    out.push(json!({ "error": { "message": f.message, "type": "server_error", "code": f.code } }).to_string());
                    return Some((out, s));
                }
                Some(Event::Rejected(r)) => {
                    out.push(json!({ "error": { "message": r.to_string(), "type": "server_error", "code": r.code() } }).to_string());
                    return Some((out, s));
                }
                None => return None,
            };
            let (text, tokens) = s.choice.take_ready();
            if ended {
                let mut v = s.meta.chunk(&tok, s.index, &text, &tokens, s.choice.finish, s.first_chunk);
                if s.meta.choices == 1 && s.meta.include_usage {
                    v["usage"] = usage(s.meta.prompt_tokens, s.choice.generated);
                }
                let total = s.meta.streamed.fetch_add(s.choice.generated, Ordering::SeqCst) + s.choice.generated;
                s.meta.finished(total, s.choice.finish.into_iter());
                out.push(v.to_string());
                return Some((out, s)); // rx dropped: a stop string ends the generation
            }
            if !text.is_empty() || !tokens.is_empty() {
                out.push(s.meta.chunk(&tok, s.index, &text, &tokens, None, s.first_chunk).to_string());
                s.first_chunk = false;
            }
            if !out.is_empty() {
                s.rx = Some(rx);
                return Some((out, s));
            }
        }
    });
    batches.flat_map(|datas| futures::stream::iter(datas.into_iter().map(|d| Ok(SseEvent::default().data(d)))))
}

/// After every choice of a stream: the usage of all of them (when `n` > 1 and usage is wanted;
/// a single choice carries it in its last chunk), then `[DONE]`.
fn usage_tail(meta: Arc<Meta>) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    futures::stream::once(async move {
        let mut datas = Vec::new();
        if meta.choices > 1 && meta.include_usage {
            let v = json!({
                "id": meta.id, "object": meta.object(true), "created": meta.created, "model": meta.model, "choices": [],
                "usage": usage(meta.prompt_tokens, meta.streamed.load(Ordering::SeqCst)),
            });
            datas.push(v.to_string());
        }
        datas.push("[DONE]".to_string());
        futures::stream::iter(datas.into_iter().map(|d| Ok(SseEvent::default().data(d))))
    })
    .flatten()
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
