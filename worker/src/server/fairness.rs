//! Per-client fairness on the public API: one client (its API key, else its address) has at most
//! so many requests in flight; more are answered 429 at once, so a greedy client cannot hold
//! the whole pool while others wait. A request counts until its response body is finished or
//! dropped (a streaming answer counts for as long as it streams).

use std::net::IpAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

use super::AppState;
use super::error::ApiError;
use super::shares::Shares;
use crate::listener::ClientAddr;

/// Who a request is from, for fairness. An API key is kept as its hash only.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ClientKey {
    ApiKey([u8; 32]),
    Addr(IpAddr),
    /// Neither (a test that calls the router without a listener).
    Unknown,
}

impl ClientKey {
    pub fn of(req: &Request) -> ClientKey {
        let bearer = req.headers().get(header::AUTHORIZATION).and_then(|h| h.to_str().ok()).and_then(|h| h.strip_prefix("Bearer "));
        match (bearer, req.extensions().get::<ClientAddr>()) {
            (Some(key), _) if !key.trim().is_empty() => ClientKey::ApiKey(kvgate_proto::auth::body_hash(key.trim().as_bytes()).0),
            (_, Some(addr)) => ClientKey::Addr(addr.0.ip()),
            _ => ClientKey::Unknown,
        }
    }
}

/// Requests in flight per client.
pub type InFlight = Shares<ClientKey>;

/// Most requests in flight per client, with no total (the pool's admission bounds that).
pub fn in_flight(per_client: usize) -> Arc<InFlight> {
    Shares::new(per_client)
}

fn refused(per_client: usize) -> ApiError {
    ApiError {
        status: StatusCode::TOO_MANY_REQUESTS,
        kind: "rate_limit_error",
        code: "too_many_requests_in_flight".into(),
        param: None,
        message: format!(
            "This client already has {per_client} requests in flight, the most one client may have (--max-requests-per-client); retry when one finishes."
        ),
    }
}

/// Middleware for generating routes: a ticket per request, held by the response body.
pub async fn limit(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Ok(ticket) = state.in_flight.take(ClientKey::of(&req)) else {
        state.count(429);
        return refused(state.in_flight.per_key()).into_response();
    };
    let (parts, body) = next.run(req).await.into_parts();
    let stream = body.into_data_stream().map(move |chunk| {
        let _held = &ticket;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_api_key_is_its_own_client_whatever_its_address_and_is_kept_hashed() {
        let req = |key: Option<&str>, ip: &str| {
            let mut r = Request::new(Body::empty());
            if let Some(k) = key {
                r.headers_mut().insert(header::AUTHORIZATION, format!("Bearer {k}").parse().unwrap());
            }
            r.extensions_mut().insert(ClientAddr(format!("{ip}:1").parse().unwrap()));
            r
        };
        let (k1, k2) = (ClientKey::of(&req(Some("sk-1"), "10.0.0.1")), ClientKey::of(&req(Some("sk-1"), "10.0.0.2")));
        assert_eq!(k1, k2);
        assert!(!format!("{k1:?}").contains("sk-1"));
        assert_eq!(ClientKey::of(&req(None, "10.0.0.1")), ClientKey::Addr("10.0.0.1".parse().unwrap()));
        let e = refused(16);
        assert_eq!((e.status, e.code.as_str()), (StatusCode::TOO_MANY_REQUESTS, "too_many_requests_in_flight"));
    }
}
