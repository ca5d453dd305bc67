//! The admission decision, made before a single page is reserved.

use kvgate_proto::codes::ErrorCode;
use std::time::Duration;

use thiserror::Error;

/// Why a request was turned away. Each variant is one `reason` label of
/// `kvgate_requests_rejected_total` and one HTTP status.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum Rejection {
    #[error(
        "This model's maximum context length is {window} tokens. However, you requested {total} tokens \
         ({prompt} in the prompt, {max_tokens} for the completion). Please reduce the length of the prompt \
         or max_tokens."
    )]
    ContextLength { prompt: usize, max_tokens: usize, total: usize, window: usize },
    #[error(
        "The request needs {needed} tokens of KV cache ({prompt} in the prompt plus {max_tokens} for the \
         completion) but the KV pool holds {capacity} tokens in all: it can never fit."
    )]
    NeverFits { prompt: usize, max_tokens: usize, needed: usize, capacity: usize },
    #[error("The KV pool stayed full for {waited_ms} ms; no pages were free for this request. Retry later.")]
    PoolBusy { waited_ms: u64 },
    #[error("The prompt is empty.")]
    EmptyPrompt,
}

impl Rejection {
    /// Every reason: the label values of `kvgate_requests_rejected_total`.
    pub const REASONS: [&'static str; 4] = crate::metrics::REJECTION_REASONS;

    pub fn reason(&self) -> &'static str {
        match self {
            Rejection::ContextLength { .. } => "context_length_exceeded",
            Rejection::NeverFits { .. } => "prompt_too_large",
            Rejection::PoolBusy { .. } => "pool_busy",
            Rejection::EmptyPrompt => "invalid_request",
        }
    }

    /// The error code a client is answered with; spelt as `reason`.
    pub fn code(&self) -> ErrorCode {
        match self {
            Rejection::ContextLength { .. } => ErrorCode::ContextLengthExceeded,
            Rejection::NeverFits { .. } => ErrorCode::PromptTooLarge,
            Rejection::PoolBusy { .. } => ErrorCode::PoolBusy,
            Rejection::EmptyPrompt => ErrorCode::InvalidRequest,
        }
    }

    /// The `reason` label of a failure whose code is a rejection's (a peer rejected the
    /// request): how it is counted.
    pub fn reason_of(code: ErrorCode) -> Option<&'static str> {
        match code {
            ErrorCode::ContextLengthExceeded => Some("context_length_exceeded"),
            ErrorCode::PromptTooLarge => Some("prompt_too_large"),
            ErrorCode::PoolBusy => Some("pool_busy"),
            ErrorCode::InvalidRequest => Some("invalid_request"),
            _ => None,
        }
    }

    pub fn pool_busy(waited: Duration) -> Self {
        Rejection::PoolBusy { waited_ms: waited.as_millis() as u64 }
    }
}

/// Limits a request is admitted against.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The declared context window.
    pub window: usize,
    /// Measured pool capacity, in tokens (whole pages).
    pub pool_tokens: usize,
}

/// Checks a request against the declared window and the measured pool.
pub fn admit(limits: Limits, prompt: usize, max_tokens: usize) -> Result<(), Rejection> {
    if prompt == 0 {
        return Err(Rejection::EmptyPrompt);
    }
    let total = prompt + max_tokens;
    if total > limits.window {
        return Err(Rejection::ContextLength { prompt, max_tokens, total, window: limits.window });
    }
    if total > limits.pool_tokens {
        return Err(Rejection::NeverFits { prompt, max_tokens, needed: total, capacity: limits.pool_tokens });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_is_checked_first_and_named() {
        let limits = Limits { window: 100, pool_tokens: 1000 };
        assert_eq!(admit(limits, 90, 10), Ok(()));
        let r = admit(limits, 95, 10).unwrap_err();
        assert_eq!(r.reason(), "context_length_exceeded");
        let msg = r.to_string();
        assert!(msg.contains("100 tokens") && msg.contains("105 tokens"), "{msg}");
    }

    #[test]
    fn the_incident_is_refused_before_any_page_is_touched() {
        // Window declared bigger than the measured pool: a long prompt passes the window check
        // but can never fit the pool.
        let limits = Limits { window: 1_048_576, pool_tokens: 681_280 };
        let r = admit(limits, 700_000, 16).unwrap_err();
        assert_eq!(r.reason(), "prompt_too_large");
        assert!(r.to_string().contains("681280") && r.to_string().contains("700016"), "{r}");
    }

    #[test]
    fn empty_prompts_are_invalid() {
        assert_eq!(admit(Limits { window: 10, pool_tokens: 10 }, 0, 1), Err(Rejection::EmptyPrompt));
    }

    #[test]
    fn every_rejection_has_a_known_reason_label() {
        let all = [
            Rejection::ContextLength { prompt: 1, max_tokens: 1, total: 2, window: 1 },
            Rejection::NeverFits { prompt: 1, max_tokens: 1, needed: 2, capacity: 1 },
            Rejection::PoolBusy { waited_ms: 1 },
            Rejection::EmptyPrompt,
        ];
        for r in all {
            assert!(Rejection::REASONS.contains(&r.reason()));
            assert_eq!(r.code().to_string(), r.reason(), "one spelling");
            assert_eq!(Rejection::reason_of(r.code()), Some(r.reason()));
        }
    }
}
