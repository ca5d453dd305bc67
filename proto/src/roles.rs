//! JSON bodies the router, prefill and decode roles exchange over HTTP.

use serde::{Deserialize, Serialize};

use crate::auth::{Mac, ReservationFields};
use crate::handoff::HandoffId;
use crate::logprobs::TokenLogprobs;
use crate::refusal::Refusal;

/// Decode: reserve pages for a whole sequence (router and the operator's canary call it).
pub const RESERVE_PATH: &str = "/internal/v1/reserve";
/// Prefill: compute a prompt's KV and send it into a reservation.
pub const PREFILL_PATH: &str = "/internal/v1/prefill";

/// Decode: give a reservation's pages back.
pub fn cancel_path(id: HandoffId) -> String {
    format!("/internal/v1/handoffs/{id}/cancel")
}

/// Decode: generate from a committed handoff (an NDJSON stream of [`StreamLine`]s).
pub fn generate_path(id: HandoffId) -> String {
    format!("/internal/v1/handoffs/{id}/generate")
}

/// Router -> decode: reserve pages for a whole sequence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReserveRequest {
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    /// The tenant whose request this is: the reservation, its tag and every frame of its
    /// transfer are bound to it.
    pub tenant: crate::tenant_id::TenantId,
    /// The caller's W3C `traceparent` (inside the signed body, so nobody without the secret can
    /// graft a call onto another trace). Decode keeps it with the reservation: its spans of the
    /// handoff's receipt and commit join that trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

/// Decode -> router: the reservation prefill must fill.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    /// 32 hex digits on the wire.
    pub handoff_id: HandoffId,
    /// Decode page ids the prompt's KV must land in, in order.
    pub pages: Vec<u32>,
    /// Tokens the transfer must carry: exactly the prompt.
    pub reserved_tokens: u32,
    /// Tokens decode reserved room to generate; generate may ask for no more.
    pub max_tokens: u32,
    /// Unix time in milliseconds after which the reservation is void.
    pub expires_ms: u64,
    /// Decode's tag over the reservation (64 hex digits on the wire; see
    /// `auth::DeploymentKey::reservation_tag`): prefill recomputes it and refuses a reservation
    /// it does not verify.
    pub tag: Mac,
    /// Decode's KV port, `host:port` (covered by the tag).
    pub kv_addr: String,
    pub model_fingerprint: String,
    pub layout_fingerprint: String,
    /// The tenant the reservation holds room for (covered by the tag).
    pub tenant: crate::tenant_id::TenantId,
}

impl Reservation {
    /// What the reservation's tag covers.
    pub fn fields(&self) -> ReservationFields<'_> {
        ReservationFields {
            handoff: self.handoff_id,
            reserved_tokens: self.reserved_tokens,
            max_tokens: self.max_tokens,
            expires_ms: self.expires_ms,
            pages: &self.pages,
            kv_addr: &self.kv_addr,
            tenant: self.tenant.tag(),
        }
    }
}

/// Router -> prefill: compute this prompt's KV and send it into the reservation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefillRequest {
    pub prompt: Vec<u32>,
    /// The tenant whose prompt this is; prefill refuses a reservation held for another.
    pub tenant: crate::tenant_id::TenantId,
    pub reservation: Reservation,
    /// How the first token is chosen (prefill samples it, as a colocated engine would); absent
    /// means greedy.
    #[serde(default)]
    pub sampling: Option<Sampling>,
    /// The caller's W3C `traceparent` (inside the signed body, so nobody without the secret can
    /// graft a call onto another trace); the callee's spans join that trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

/// Prefill -> router: decode's verdict on the transfer, as prefill heard it. On the wire
/// `{"ok", "reason", "message"}` (the reason empty when accepted); a reason outside the closed
/// set, or one beside `ok: true`, does not parse.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(into = "PrefillWire", try_from = "PrefillWire")]
pub struct PrefillResponse {
    /// Decode's refusal; `None`: the handoff was committed.
    pub refused: Option<Refusal>,
    pub message: String,
    /// Each prompt token's log-probability (none for the first), when the request asked for
    /// them (`echo` with `logprobs`).
    pub prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
}

#[derive(Serialize, Deserialize)]
struct PrefillWire {
    ok: bool,
    reason: String,
    message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
}

impl From<PrefillResponse> for PrefillWire {
    fn from(r: PrefillResponse) -> Self {
        let reason = r.refused.map_or("", Refusal::as_str).to_string();
        PrefillWire { ok: r.refused.is_none(), reason, message: r.message, prompt_logprobs: r.prompt_logprobs }
    }
}

impl TryFrom<PrefillWire> for PrefillResponse {
    type Error = String;

    fn try_from(w: PrefillWire) -> Result<Self, String> {
        let refused = match (w.ok, w.reason.as_str()) {
            (true, "") => None,
            (true, other) => return Err(format!("reason: an accepted handoff carries none, got {other:?}")),
            (false, reason) => Some(Refusal::parse(reason).ok_or_else(|| format!("reason: {reason:?} is not a refusal reason"))?),
        };
        Ok(PrefillResponse { refused, message: w.message, prompt_logprobs: w.prompt_logprobs })
    }
}

/// Why a generation ended, spelled as OpenAI's `finish_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// The model produced an end-of-sequence token.
    Stop,
}

impl FinishReason {
    pub const fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
        }
    }
}

/// Router -> decode: cancel a reservation (prefill rejected the prompt, or failed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelRequest {
    /// True when prefill *rejected* the prompt: any transfer that still arrives for it is a
    /// rejected request being forwarded, and is counted as such.
    pub rejected: bool,
    /// The caller's W3C `traceparent` (inside the signed body, so nobody without the secret can
    /// graft a call onto another trace); the callee's spans join that trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

/// Sampling settings carried to decode.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub seed: Option<u64>,
    /// Each generated token's log-probability, with this many alternatives.
    #[serde(default)]
    pub logprobs: Option<u8>,
    /// The log-probability of every prompt token (computed by prefill).
    #[serde(default)]
    pub prompt_logprobs: bool,
    /// Generate past end-of-sequence tokens, up to `max_tokens`.
    #[serde(default)]
    pub ignore_eos: bool,
}

/// Router -> decode: generate from a committed handoff.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    /// The tenant asking; decode generates only from a handoff reserved for it.
    pub tenant: crate::tenant_id::TenantId,
    pub max_tokens: u32,
    pub sampling: Sampling,
    /// How long decode waits for the commit before it declares the handoff timed out; absent
    /// means until the reservation expires.
    #[serde(default)]
    pub commit_wait_ms: Option<u64>,
    /// The caller's W3C `traceparent` (inside the signed body, so nobody without the secret can
    /// graft a call onto another trace); the callee's spans join that trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

/// One line of decode's newline-delimited JSON token stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamLine {
    Token(u32),
    /// A token with its log-probabilities (when the client asked for them).
    Scored {
        token: u32,
        logprobs: TokenLogprobs,
    },
    Done {
        finish: FinishReason,
        prompt_tokens: u32,
        completion_tokens: u32,
    },
    Error {
        status: u16,
        code: crate::codes::ErrorCode,
        message: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_lines_are_tagged_objects() {
        assert_eq!(serde_json::to_string(&StreamLine::Token(7)).unwrap(), r#"{"token":7}"#);
        let done = StreamLine::Done { finish: FinishReason::Length, prompt_tokens: 3, completion_tokens: 4 };
        let text = serde_json::to_string(&done).unwrap();
        assert_eq!(text, r#"{"done":{"finish":"length","prompt_tokens":3,"completion_tokens":4}}"#);
        assert_eq!(serde_json::from_str::<StreamLine>(&text).unwrap(), done);
        assert!(serde_json::from_str::<StreamLine>(r#"{"done":{"finish":"eos","prompt_tokens":3,"completion_tokens":4}}"#).is_err());
    }

    #[test]
    fn a_prefill_verdict_is_ok_or_one_refusal_reason() {
        let refused = PrefillResponse { refused: Some(Refusal::parse("token_count").unwrap()), message: "16 of 20".into(), prompt_logprobs: None };
        let text = serde_json::to_string(&refused).unwrap();
        assert_eq!(text, r#"{"ok":false,"reason":"token_count","message":"16 of 20"}"#);
        assert_eq!(serde_json::from_str::<PrefillResponse>(&text).unwrap(), refused);
        let ok = r#"{"ok":true,"reason":"","message":""}"#;
        assert_eq!(serde_json::from_str::<PrefillResponse>(ok).unwrap().refused, None);
        for bad in [r#"{"ok":false,"reason":"gremlins","message":""}"#, r#"{"ok":true,"reason":"checksum","message":""}"#] {
            let e = serde_json::from_str::<PrefillResponse>(bad).unwrap_err().to_string();
            assert!(e.starts_with("reason: "), "{bad}: {e}");
        }
    }
}
