//! Request body limits, derived from the declared context window so that a prompt of the whole
//! window always fits (axum's fixed 2 MB default capped a 1M-token window at ~600k tokens), and
//! the deadline a body must arrive within (a body sent without its last byte holds memory only
//! that long).

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;

use super::AppState;
use super::error::ApiError;

/// Fixed room for everything in a body that is not the prompt.
const BASE: usize = 1 << 20;

/// Public API (`/v1/*`): the prompt as JSON text or token ids. 16 bytes a token covers a
/// token id with its comma (at most 11) and the text of a token with JSON escapes.
pub fn public_body(window: usize) -> usize {
    BASE.saturating_add(window.saturating_mul(16))
}

/// Internal calls between roles: the prompt as token ids (at most 11 bytes each) plus the
/// reservation's page ids (at most one page a token, 11 bytes each).
pub fn internal_body(window: usize) -> usize {
    BASE.saturating_add(window.saturating_mul(24))
}

/// Most log-probability entries and echoed prompt tokens one answer may carry: about 16 MiB
/// of JSON (an entry is up to ~64 bytes), a bounded share of a worker's memory however the
/// fields multiply (`n` up to 16, `logprobs` up to 20, a prompt up to the window).
pub const MAX_RESPONSE_ENTRIES: u64 = 1 << 18;

/// What one request asks the server to produce beyond plain text.
#[derive(Debug, Clone, Copy)]
pub struct ResponseShape {
    pub choices: usize,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    pub echo: bool,
    /// Top log-probabilities per token, when any are asked for.
    pub logprobs: Option<u8>,
}

impl ResponseShape {
    /// `n` x (echoed prompt tokens + `max_tokens` when log-probabilities are asked for) x
    /// (1 + `logprobs`).
    pub fn entries(&self) -> u64 {
        let per_token = 1 + self.logprobs.map_or(0, u64::from);
        let echoed = if self.echo { self.prompt_tokens as u64 } else { 0 };
        let generated = if self.logprobs.is_some() { self.max_tokens as u64 } else { 0 };
        (self.choices as u64).saturating_mul(echoed.saturating_add(generated)).saturating_mul(per_token)
    }

    /// A 400 naming the fields when the answer would carry more than [`MAX_RESPONSE_ENTRIES`].
    pub fn check(&self) -> Result<(), ApiError> {
        let entries = self.entries();
        if entries <= MAX_RESPONSE_ENTRIES {
            return Ok(());
        }
        let param = if self.logprobs.is_some() { "logprobs" } else { "echo" };
        Err(ApiError::invalid(
            param,
            format!(
                "`n` ({}) x (echoed prompt tokens ({}) + `max_tokens` with log-probabilities ({})) x (1 + `logprobs` ({})) = {entries} entries; one answer may carry at most {MAX_RESPONSE_ENTRIES} (lower `n`, `logprobs` or `max_tokens`, or drop `echo`)",
                self.choices,
                if self.echo { self.prompt_tokens } else { 0 },
                if self.logprobs.is_some() { self.max_tokens } else { 0 },
                self.logprobs.unwrap_or(0),
            ),
        ))
    }
}

/// Least time a body may take to arrive, whatever its size; larger ones get a second more per
/// 8 MiB (a peer slower than that is stalling, not sending).
const BODY_TIME: Duration = Duration::from_secs(5);
const BODY_RATE: u64 = 8 << 20;

/// How long a body of `len` bytes may take to arrive.
pub fn body_deadline(len: u64) -> Duration {
    BODY_TIME + Duration::from_secs(len / BODY_RATE)
}

/// A body that arrived too slowly, as the client sees it (408).
pub fn too_slow(len: u64) -> ApiError {
    ApiError {
        status: StatusCode::REQUEST_TIMEOUT,
        kind: "invalid_request_error",
        code: kvgate_proto::codes::ErrorCode::BodyTooSlow,
        param: Some("body".into()),
        message: format!("The request body ({len} bytes at most) did not arrive within {} s.", body_deadline(len).as_secs()),
    }
}

/// Middleware for public routes: reads the body, up to the window's limit, within its
/// deadline, and hands it on whole. A body over the limit is read to its end and dropped (a
/// client still writing it then reads its 413 instead of a broken pipe); 408 when too slow.
/// Refusals are counted as the handlers count theirs.
pub async fn read_public_body(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let limit = public_body(state.window);
    let (parts, body) = req.into_parts();
    let declared = parts.headers.get(header::CONTENT_LENGTH).and_then(|h| h.to_str().ok()?.parse::<u64>().ok());
    // The deadline of a body of at most the limit: a longer one is cut off there.
    let expected = declared.unwrap_or(limit as u64).min(limit as u64);
    let read = async {
        let mut body = body;
        let mut out = Vec::with_capacity(declared.unwrap_or(0).min(limit as u64) as usize);
        let mut over = false;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| ApiError::invalid("body", format!("reading the request body: {e}")))?;
            if let Ok(chunk) = frame.into_data() {
                over = over || out.len() + chunk.len() > limit;
                if over {
                    out = Vec::new(); // nothing of it is kept
                } else {
                    out.extend_from_slice(&chunk);
                }
            }
        }
        if over { Err(ApiError::body_too_large(limit)) } else { Ok(Bytes::from(out)) }
    };
    let refused = match tokio::time::timeout(body_deadline(expected), read).await {
        Ok(Ok(bytes)) => return next.run(Request::from_parts(parts, Body::from(bytes))).await,
        Ok(Err(e)) => e,
        Err(_) if declared.is_some_and(|d| d > limit as u64) => ApiError::body_too_large(limit),
        Err(_) => too_slow(expected),
    };
    state.count(refused.status.as_u16());
    refused.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_budget_multiplies_choices_echo_tokens_and_logprobs() {
        let plain = ResponseShape { choices: 16, prompt_tokens: 8000, max_tokens: 8192, echo: false, logprobs: None };
        assert_eq!(plain.entries(), 0, "plain text is bounded by the window and n alone");
        assert!(plain.check().is_ok());
        // The attack of issue 26 row 4: echo, logprobs 20, n 16, an 8,000-token prompt.
        let greedy = ResponseShape { echo: true, logprobs: Some(20), max_tokens: 16, ..plain };
        assert_eq!(greedy.entries(), 16 * (8000 + 16) * 21);
        let e = greedy.check().unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logprobs"));
        assert!(e.message.contains("2693376 entries") && e.message.contains("262144"), "{}", e.message);
        let fine = ResponseShape { choices: 1, echo: true, logprobs: Some(5), prompt_tokens: 2000, max_tokens: 256 };
        assert!(fine.check().is_ok(), "{}", fine.entries());
        let echo_only = ResponseShape { choices: 1, echo: true, logprobs: None, prompt_tokens: 1 << 20, max_tokens: 1 };
        assert_eq!(echo_only.check().unwrap_err().param.as_deref(), Some("echo"));
    }

    #[test]
    fn a_whole_window_of_the_largest_token_ids_fits() {
        for window in [1, 8192, 1_048_576] {
            let ids = vec![u32::MAX; window];
            let prompt = serde_json::to_vec(&ids).unwrap();
            let body = serde_json::to_vec(&serde_json::json!({ "prompt": ids, "max_tokens": 1 })).unwrap();
            assert!(body.len() <= public_body(window), "{window}: {} > {}", body.len(), public_body(window));
            // Internally the prompt travels with a page id per token at worst.
            assert!(2 * prompt.len() <= internal_body(window));
        }
        assert_eq!(public_body(usize::MAX), usize::MAX, "saturates instead of wrapping");
    }
}
