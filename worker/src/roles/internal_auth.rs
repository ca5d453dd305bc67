//! Authenticated calls between a deployment's roles. The caller signs method, path, time, a
//! nonce and the body with the deployment's request key (`kvgate_proto::auth`); the callee's
//! middleware checks the body size, the MAC, the clock skew and that the nonce is new, before any
//! handler runs. Refusals are 401 (413 for a body over the limit) with an OpenAI-shaped body, and
//! counted in `kvgate_internal_requests_rejected_total{reason}`.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use kvgate_proto::auth::{AuthError, DeploymentKey, SIGNATURE_HEADER, Signature};
use prometheus::{IntCounterVec, Registry};

use crate::handoff::Secret;
use crate::metrics::RoleRegistry;
use crate::server::error::ApiError;

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

    /// The signature header value for a POST of `body` to `path`.
    pub fn sign(&self, path: &str, body: &[u8]) -> String {
        self.0.sign_request("POST", path, now_ms(), rand::random(), body).to_string()
    }

    /// A signed JSON POST of `body` to `base` + `path`.
    pub fn post(&self, http: &reqwest::Client, base: &str, path: &str, body: &impl serde::Serialize) -> reqwest::RequestBuilder {
        let bytes = serde_json::to_vec(body).expect("role bodies serialize");
        http.post(format!("{base}{path}")).header(SIGNATURE_HEADER, self.sign(path, &bytes)).header("content-type", "application/json").body(bytes)
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
    nonces: Mutex<NonceCache>,
    body_limit: usize,
    rejected: IntCounterVec,
}

/// Reasons of `kvgate_internal_requests_rejected_total`: the signature's, and an oversized body.
pub const REJECT_REASONS: [&str; 6] = ["missing", "malformed", "stale", "replayed", "bad_mac", "too_large"];

impl Verifier {
    pub fn new(secret: &Secret, body_limit: usize, registry: &Registry, role: &str) -> Arc<Self> {
        let r = RoleRegistry { registry, role };
        let rejected = r.counter_vec(
            "kvgate_internal_requests_rejected_total",
            "Calls to internal endpoints refused before any handler ran (unauthenticated, replayed, stale or oversized), by reason.",
            "reason",
            &REJECT_REASONS,
        );
        Arc::new(Verifier { key: secret.key().clone(), nonces: Mutex::default(), body_limit, rejected })
    }

    /// Checks one request's signature against its method, path and body.
    pub fn check(&self, header: Option<&str>, method: &str, path: &str, body: &[u8]) -> Result<(), AuthError> {
        let sig: Signature = header.ok_or(AuthError::Missing)?.parse()?;
        let now = now_ms();
        self.key.verify_request(&sig, method, path, body, now, MAX_SKEW.as_millis() as u64)?;
        if !self.nonces.lock().unwrap_or_else(|p| p.into_inner()).insert(sig.nonce, now) {
            return Err(AuthError::Replayed);
        }
        Ok(())
    }

    fn refuse(&self, e: AuthError) -> Response {
        self.rejected.with_label_values(&[e.reason()]).inc();
        // Counted, not logged loudly: whoever can reach the port could otherwise flood the log.
        tracing::debug!(reason = e.reason(), "internal request refused: {e}");
        let kind = "authentication_error";
        ApiError { status: StatusCode::UNAUTHORIZED, kind, code: "unauthenticated".into(), param: None, message: e.to_string() }.into_response()
    }
}

/// Middleware for internal routes: the body is read (up to the limit), authenticated, and only
/// then handed on.
pub async fn require_signature(State(v): State<Arc<Verifier>>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, v.body_limit).await else {
        v.rejected.with_label_values(&["too_large"]).inc();
        return ApiError::body_too_large(v.body_limit).into_response();
    };
    let header = parts.headers.get(SIGNATURE_HEADER).map(|h| h.to_str().unwrap_or(""));
    if let Err(e) = v.check(header, parts.method.as_str(), parts.uri.path(), &bytes) {
        return v.refuse(e);
    }
    next.run(Request::from_parts(parts, Body::from(bytes))).await
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
    fn the_verifier_refuses_missing_forged_and_replayed_signatures() {
        let secret = Secret::new(&[4; 32]).unwrap();
        let v = Verifier::new(&secret, 1 << 20, &Registry::new(), "decode");
        let signer = Signer::new(&secret);
        let sig = signer.sign("/internal/v1/reserve", b"{}");
        assert_eq!(v.check(None, "POST", "/internal/v1/reserve", b"{}"), Err(AuthError::Missing));
        assert!(matches!(v.check(Some("v1;bogus"), "POST", "/internal/v1/reserve", b"{}"), Err(AuthError::Malformed(_))));
        assert_eq!(v.check(Some(sig.as_str()), "POST", "/internal/v1/reserve", b"{\"x\":1}"), Err(AuthError::BadMac));
        assert_eq!(v.check(Some(sig.as_str()), "POST", "/internal/v1/reserve", b"{}"), Ok(()));
        assert_eq!(v.check(Some(sig.as_str()), "POST", "/internal/v1/reserve", b"{}"), Err(AuthError::Replayed));
        let other = Signer::new(&Secret::new(&[5; 32]).unwrap()).sign("/internal/v1/reserve", b"{}");
        assert_eq!(v.check(Some(other.as_str()), "POST", "/internal/v1/reserve", b"{}"), Err(AuthError::BadMac));
    }
}
