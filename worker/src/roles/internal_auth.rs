//! Authenticated calls between a deployment's roles. The caller signs method, path and query,
//! the callee's instance, time, a nonce and the body's length and hash with the deployment's
//! request key (`kvgate_proto::auth`). The callee's middleware checks the header first (MAC,
//! target, clock skew, a new nonce, a declared length within the limit), and only then reads the
//! body, in chunks, within a deadline, stopping at the declared length and checking its hash: a
//! caller without the secret gets no byte of its body buffered. Refusals are 401 (413 for a body
//! over the limit, 408 for one too slow) with an OpenAI-shaped body, and counted in
//! `kvgate_internal_requests_rejected_total{reason}`.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use kvgate_proto::auth::{AuthError, BodyHasher, DeploymentKey, Instance, SIGNATURE_HEADER, Signature};
use prometheus::{IntCounterVec, Registry};

use crate::handoff::Secret;
use crate::metrics::RoleRegistry;
use crate::server::error::ApiError;
use crate::server::limits;

/// Response header naming why a call was refused, so a caller can tell a restarted peer
/// (`wrong_target`: re-read its report, call again) from a refusal without reading the body.
pub const REFUSED_HEADER: &str = "x-kvgate-refused";

/// How far a signature's clock may be from ours.
pub const MAX_SKEW: Duration = Duration::from_secs(30);

pub use kvgate_proto::auth::now_ms;

/// Signs the requests a role sends to its peers.
#[derive(Clone, Debug)]
pub struct Signer(DeploymentKey);

impl Signer {
    pub fn new(secret: &Secret) -> Self {
        Signer(secret.key().clone())
    }

    /// The signature header value for a POST of `body` to `path` (with its query) at `target`.
    pub fn sign(&self, path: &str, target: Instance, body: &[u8]) -> String {
        self.0.sign_request("POST", path, target, now_ms(), rand::random(), body).to_string()
    }

    /// A signed JSON POST of `body` to `base` + `path`, good at the process `target` only.
    pub fn post(&self, http: &reqwest::Client, base: &str, target: Instance, path: &str, body: &impl serde::Serialize) -> reqwest::RequestBuilder {
        let bytes = serde_json::to_vec(body).expect("role bodies serialize");
        http.post(format!("{base}{path}")).header(SIGNATURE_HEADER, self.sign(path, target, &bytes)).header("content-type", "application/json").body(bytes)
    }
}

/// Nonces of signatures accepted within the skew window (older ones are stale anyway).
#[derive(Default)]
struct NonceCache {
    seen: HashSet<u128>,
    order: VecDeque<(u64, u128)>,
}

/// Most nonces remembered; past this the oldest are forgotten early (they are still refused as
/// stale once out of the window, so this bounds memory, not safety within one window).
const MAX_NONCES: usize = 1 << 20;

impl NonceCache {
    /// Records `nonce`; false when it was already there.
    fn insert(&mut self, nonce: u128, now_ms: u64) -> bool {
        let horizon = now_ms.saturating_sub(2 * MAX_SKEW.as_millis() as u64);
        while let Some(&(at, old)) = self.order.front() {
            if at >= horizon && self.order.len() < MAX_NONCES {
                break;
            }
            self.order.pop_front();
            self.seen.remove(&old);
        }
        if !self.seen.insert(nonce) {
            return false;
        }
        self.order.push_back((now_ms, nonce));
        true
    }
}

/// The callee's side: checks every request to an internal route.
pub struct Verifier {
    key: DeploymentKey,
    /// This process, as callers name it (published in its capacity report).
    me: Instance,
    nonces: Mutex<NonceCache>,
    body_limit: usize,
    rejected: IntCounterVec,
}

/// Reasons of `kvgate_internal_requests_rejected_total`: the signature's, then a body over the
/// limit or too slow to arrive.
pub const REJECT_REASONS: [&str; 9] = ["missing", "malformed", "stale", "replayed", "bad_mac", "wrong_target", "body_mismatch", "too_large", "too_slow"];

impl Verifier {
    pub fn new(secret: &Secret, me: Instance, body_limit: usize, registry: &Registry, role: &str) -> Arc<Self> {
        let r = RoleRegistry { registry, role };
        let rejected = r.counter_vec(
            "kvgate_internal_requests_rejected_total",
            "Calls to internal endpoints refused before any handler ran (unauthenticated, replayed, aimed at another process, stale, oversized or too slow), by reason.",
            "reason",
            &REJECT_REASONS,
        );
        Arc::new(Verifier { key: secret.key().clone(), me, nonces: Mutex::default(), body_limit, rejected })
    }

    /// Checks one request's signature header against its method and path (with query), before
    /// any of its body is read.
    pub fn check(&self, header: Option<&str>, method: &str, path: &str) -> Result<Signature, AuthError> {
        let sig: Signature = header.ok_or(AuthError::Missing)?.parse()?;
        let now = now_ms();
        self.key.verify_request(&sig, method, path, self.me, now, MAX_SKEW.as_millis() as u64)?;
        if !self.nonces.lock().unwrap_or_else(|p| p.into_inner()).insert(sig.nonce, now) {
            return Err(AuthError::Replayed);
        }
        Ok(sig)
    }

    fn refuse(&self, e: AuthError) -> Response {
        self.rejected.with_label_values(&[e.reason()]).inc();
        // Counted, not logged loudly: whoever can reach the port could otherwise flood the log.
        tracing::debug!(reason = e.reason(), "internal request refused: {e}");
        let kind = "authentication_error";
        let code = match e {
            // The caller holds the secret but named another process: it re-reads our report.
            AuthError::WrongTarget => kvgate_proto::codes::ErrorCode::WrongTarget,
            _ => kvgate_proto::codes::ErrorCode::Unauthenticated,
        };
        let mut resp = ApiError { status: StatusCode::UNAUTHORIZED, kind, code, param: None, message: e.to_string() }.into_response();
        resp.headers_mut().insert(REFUSED_HEADER, axum::http::HeaderValue::from_static(e.reason()));
        resp
    }

    /// Reads the body the signature names: in chunks, never past `sig.body_len`, within its
    /// deadline, hashed on the way.
    async fn read_body(&self, sig: &Signature, body: Body) -> Result<Bytes, Response> {
        let len = sig.body_len;
        let read = async {
            let mut body = body;
            let mut out = Vec::with_capacity(len as usize);
            let mut hash = BodyHasher::default();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|_| AuthError::BodyMismatch)?;
                if let Ok(chunk) = frame.into_data() {
                    if out.len() as u64 + chunk.len() as u64 > len {
                        return Err(AuthError::BodyMismatch);
                    }
                    hash.update(&chunk);
                    out.extend_from_slice(&chunk);
                }
            }
            if out.len() as u64 != len || !hash.finish().verify(&sig.body_hash) {
                return Err(AuthError::BodyMismatch);
            }
            Ok(Bytes::from(out))
        };
        match tokio::time::timeout(limits::body_deadline(len), read).await {
            Ok(Ok(bytes)) => Ok(bytes),
            Ok(Err(e)) => Err(self.refuse(e)),
            Err(_) => {
                self.rejected.with_label_values(&["too_slow"]).inc();
                Err(limits::too_slow(len).into_response())
            }
        }
    }
}

/// Middleware for internal routes: the signature is checked on the header alone, then the body
/// it names is read and handed on.
pub async fn require_signature(State(v): State<Arc<Verifier>>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let header = parts.headers.get(SIGNATURE_HEADER).map(|h| h.to_str().unwrap_or(""));
    let path = parts.uri.path_and_query().map_or(parts.uri.path(), |p| p.as_str());
    let sig = match v.check(header, parts.method.as_str(), path) {
        Ok(sig) => sig,
        Err(e) => return v.refuse(e),
    };
    let declared = parts.headers.get(header::CONTENT_LENGTH).and_then(|h| h.to_str().ok()?.parse::<u64>().ok());
    if sig.body_len > v.body_limit as u64 || declared.is_some_and(|d| d > v.body_limit as u64) {
        v.rejected.with_label_values(&["too_large"]).inc();
        return ApiError::body_too_large(v.body_limit).into_response();
    }
    if declared.is_some_and(|d| d != sig.body_len) {
        return v.refuse(AuthError::BodyMismatch);
    }
    match v.read_body(&sig, body).await {
        Ok(bytes) => next.run(Request::from_parts(parts, Body::from(bytes))).await,
        Err(refused) => refused,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nonce_is_accepted_once_and_forgotten_after_the_window() {
        let mut c = NonceCache::default();
        assert!(c.insert(1, 1_000_000));
        assert!(!c.insert(1, 1_000_001));
        assert!(c.insert(2, 1_000_002));
        // Far past the window, the old entries are pruned on the next insert.
        assert!(c.insert(3, 1_000_000 + 3 * MAX_SKEW.as_millis() as u64));
        assert_eq!(c.seen.len(), 1);
    }

    #[test]
    fn the_verifier_refuses_missing_forged_misdirected_and_replayed_signatures() {
        let secret = Secret::new(&[4; 32]).unwrap();
        let me = Instance(9);
        let v = Verifier::new(&secret, me, 1 << 20, &Registry::new(), "decode");
        let signer = Signer::new(&secret);
        let path = "/internal/v1/reserve";
        let sig = signer.sign(path, me, b"{}");
        assert_eq!(v.check(None, "POST", path), Err(AuthError::Missing));
        assert!(matches!(v.check(Some("v2;bogus"), "POST", path), Err(AuthError::Malformed(_))));
        assert_eq!(v.check(Some(sig.as_str()), "POST", "/internal/v1/prefill"), Err(AuthError::BadMac));
        let elsewhere = signer.sign(path, Instance(10), b"{}");
        assert_eq!(v.check(Some(elsewhere.as_str()), "POST", path), Err(AuthError::WrongTarget));
        assert!(v.check(Some(sig.as_str()), "POST", path).is_ok());
        assert_eq!(v.check(Some(sig.as_str()), "POST", path), Err(AuthError::Replayed));
        let other = Signer::new(&Secret::new(&[5; 32]).unwrap()).sign(path, me, b"{}");
        assert_eq!(v.check(Some(other.as_str()), "POST", path), Err(AuthError::BadMac));
    }

    #[tokio::test]
    async fn a_body_is_read_only_up_to_its_declared_length_and_must_hash_as_signed() {
        let secret = Secret::new(&[4; 32]).unwrap();
        let v = Verifier::new(&secret, Instance(9), 1 << 20, &Registry::new(), "decode");
        let sig: Signature = Signer::new(&secret).sign("/p", Instance(9), b"{}").parse().unwrap();
        assert_eq!(v.read_body(&sig, Body::from("{}")).await.ok(), Some(Bytes::from("{}")));
        for wrong in ["{ }", "{}}", "{", "[]"] {
            let refused = v.read_body(&sig, Body::from(wrong)).await.unwrap_err();
            assert_eq!(refused.status(), StatusCode::UNAUTHORIZED, "{wrong}");
        }
    }
}
