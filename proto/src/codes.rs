//! Every error code a kvgate process answers with: `error.code` of an OpenAI-style body, and the
//! code of an error line in decode's token stream. One type for all of them, so a process decides
//! on a code by matching it, and a code crosses a process boundary only as its one spelling
//! (its `Display`); a code a process does not know is refused when read, never guessed.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::refusal::Refusal;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    // A request the public API refuses.
    /// A field with a bad value (`param` names it).
    InvalidValue,
    /// An empty prompt.
    InvalidRequest,
    /// A query string that does not parse.
    InvalidQuery,
    /// A capacity report's nonce that is not 32 hex digits.
    InvalidNonce,
    /// A body over the limit.
    RequestTooLarge,
    /// A body that did not arrive in time.
    BodyTooSlow,
    /// A `model` this deployment does not serve.
    ModelNotFound,
    /// Prompt and answer over the context window.
    ContextLengthExceeded,
    /// A prompt the measured pool can never hold.
    PromptTooLarge,
    /// No pages free in time.
    PoolBusy,

    // Who may ask, and how much.
    MissingApiKey,
    InvalidApiKey,
    NotFromGateway,
    InvalidTenantHeader,
    TooManyRequestsInFlight,
    TenantTokenQuota,

    // Calls between the roles.
    /// An internal call without a valid signature.
    Unauthenticated,
    /// An internal call signed for another process (the caller re-reads this one's report).
    WrongTarget,
    /// A process without the deployment's secret asked to sign its report.
    CannotSign,
    /// A role that holds no KV pool asked for its report.
    NoKvPool,
    /// A reservation prefill cannot send to.
    ReservationInvalid,
    /// Decode holds its limit of open reservations.
    TooManyReservations,
    /// Prefill could not finish before the reservation's deadline.
    PrefillDeadlineExceeded,
    /// Decode refused a handoff: `kv_handoff_<reason>`.
    KvHandoff(Refusal),

    // The router.
    /// No prefill/decode pair is ready.
    NoPeers,
    /// Decode could not be reached at all (nothing was sent; another pair may serve it).
    PeerUnreachable,
    /// A peer answered something the router cannot use: a bad body, a broken stream.
    PeerError,

    InternalError,
}

/// Every code without a payload: its spelling, and what it tells a client.
const SIMPLE: [(ErrorCode, &str, &str); 27] = [
    (ErrorCode::InvalidValue, "invalid_value", "a field's value is not one this API accepts; `param` names the field"),
    (ErrorCode::InvalidRequest, "invalid_request", "the prompt is empty"),
    (ErrorCode::InvalidQuery, "invalid_query", "the query string of `GET /v1/kv-pool` does not parse"),
    (ErrorCode::InvalidNonce, "invalid_nonce", "a capacity report's `nonce` is not 32 hex digits"),
    (ErrorCode::RequestTooLarge, "request_too_large", "the body is over the limit, which follows the context window"),
    (ErrorCode::BodyTooSlow, "body_too_slow", "the body did not arrive within 5 s plus a second per 8 MiB"),
    (ErrorCode::ModelNotFound, "model_not_found", "`model` names a model this deployment does not serve"),
    (ErrorCode::ContextLengthExceeded, "context_length_exceeded", "prompt and `max_tokens` together exceed the context window"),
    (ErrorCode::PromptTooLarge, "prompt_too_large", "the request can never fit the measured KV pool; no page was reserved"),
    (ErrorCode::PoolBusy, "pool_busy", "no pages were free within the admission timeout; retry after `Retry-After`"),
    (ErrorCode::MissingApiKey, "missing_api_key", "the deployment needs an API key and none was sent"),
    (ErrorCode::InvalidApiKey, "invalid_api_key", "the API key is not one of the deployment's"),
    (ErrorCode::NotFromGateway, "not_from_gateway", "the deployment is served through its gateway only"),
    (ErrorCode::InvalidTenantHeader, "invalid_tenant_header", "the gateway's tenant header does not name a tenant"),
    (ErrorCode::TooManyRequestsInFlight, "too_many_requests_in_flight", "the tenant has its share of requests in flight already"),
    (ErrorCode::TenantTokenQuota, "tenant_token_quota", "the tenant's tokens per minute cannot hold the prompt now"),
    (ErrorCode::Unauthenticated, "unauthenticated", "an internal call without a valid signature of the deployment's secret"),
    (ErrorCode::WrongTarget, "wrong_target", "an internal call signed for another process (the caller re-reads this one's report)"),
    (ErrorCode::CannotSign, "cannot_sign", "a process without the deployment's secret was asked to sign its capacity report"),
    (ErrorCode::NoKvPool, "no_kv_pool", "a role without a KV pool of its own was asked for its signed report"),
    (ErrorCode::ReservationInvalid, "reservation_invalid", "prefill cannot send to the reservation it was given"),
    (ErrorCode::TooManyReservations, "too_many_reservations", "decode holds its limit of open reservations; nothing was reserved"),
    (ErrorCode::PrefillDeadlineExceeded, "prefill_deadline_exceeded", "prefill could not finish the prompt before the reservation's deadline"),
    (ErrorCode::NoPeers, "no_peers", "the router has no ready prefill/decode pair"),
    (ErrorCode::PeerUnreachable, "peer_unreachable", "the router could not reach decode (nothing was sent)"),
    (ErrorCode::PeerError, "peer_error", "a peer answered something the router cannot use: a bad body, an unknown code, a broken stream"),
    (ErrorCode::InternalError, "internal_error", "a fault of the process itself"),
];

/// The Markdown table of every code, as `docs/handoff-protocol.md` carries it (between its
/// `generated:error-codes` markers; `cargo xtask generate` writes it).
pub fn markdown_table() -> String {
    let mut out = String::from("| code | means |\n| --- | --- |\n");
    for (_, spelt, means) in SIMPLE {
        out += &format!("| `{spelt}` | {means} |\n");
    }
    out + "| `kv_handoff_<reason>` | decode refused the handoff for `reason` (the table above; `kv_handoff_cancelled`: the router cancelled the reservation) |\n"
}

const HANDOFF_PREFIX: &str = "kv_handoff_";

impl ErrorCode {
    /// The code spelt `s`, if this build knows it.
    pub fn parse(s: &str) -> Option<ErrorCode> {
        if let Some(reason) = s.strip_prefix(HANDOFF_PREFIX) {
            return Refusal::parse(reason).map(ErrorCode::KvHandoff);
        }
        SIMPLE.iter().find(|(_, spelt, _)| *spelt == s).map(|(c, ..)| *c)
    }
}

/// The one spelling of the code, on every wire.
impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ErrorCode::KvHandoff(r) => write!(f, "{HANDOFF_PREFIX}{}", r.as_str()),
            simple => f.write_str(SIMPLE.iter().find(|(c, ..)| c == simple).map(|(_, s, _)| *s).expect("every simple code is in SIMPLE")),
        }
    }
}

impl From<Refusal> for ErrorCode {
    fn from(r: Refusal) -> Self {
        ErrorCode::KvHandoff(r)
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ErrorCode::parse(&s).ok_or_else(|| serde::de::Error::custom(format!("unknown error code `{s}`")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::refusal::{Mismatch, PortRefusal};

    #[test]
    fn every_code_reads_back_as_itself_and_spellings_are_unique() {
        let handoff = Mismatch::ALL.into_iter().map(Refusal::from).chain(PortRefusal::ALL.into_iter().map(Refusal::from)).chain([Refusal::Cancelled]);
        let all: Vec<ErrorCode> = SIMPLE.iter().map(|(c, ..)| *c).chain(handoff.map(ErrorCode::KvHandoff)).collect();
        let mut spelt: Vec<String> = Vec::new();
        for code in all {
            let s = code.to_string();
            assert_eq!(ErrorCode::parse(&s), Some(code), "{s}");
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json, format!("\"{s}\""));
            assert_eq!(serde_json::from_str::<ErrorCode>(&json).unwrap(), code);
            assert!(s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'), "{s}");
            spelt.push(s);
        }
        let n = spelt.len();
        spelt.sort();
        spelt.dedup();
        assert_eq!(spelt.len(), n, "two codes share a spelling");
        assert_eq!(ErrorCode::KvHandoff(Mismatch::Checksum.into()).to_string(), "kv_handoff_checksum");
        assert_eq!(ErrorCode::KvHandoff(Mismatch::RejectedForwarded.into()).to_string(), "kv_handoff_rejected_forwarded");
    }

    #[test]
    fn an_unknown_code_is_refused_naming_it() {
        assert_eq!(ErrorCode::parse("kv_handoff_nonsense"), None);
        let e = serde_json::from_str::<ErrorCode>("\"made_up\"").unwrap_err().to_string();
        assert!(e.contains("unknown error code `made_up`"), "{e}");
    }
}
