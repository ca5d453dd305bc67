//! Per-client fairness on the public API: one client (its API key, else its address) has at most
//! so many requests in flight; more are answered 429 at once, so a greedy client cannot hold
//! the whole pool while others wait. A request counts until its response body is finished or
//! dropped (a streaming answer counts for as long as it streams).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

use super::error::ApiError;
use super::listener::ClientAddr;

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
#[derive(Debug)]
pub struct InFlight {
    per_client: usize,
    held: Mutex<HashMap<ClientKey, usize>>,
}

/// One request's place, given back when dropped.
#[derive(Debug)]
pub struct Ticket {
    owner: Arc<InFlight>,
    key: ClientKey,
}

impl InFlight {
    pub fn new(per_client: usize) -> Arc<Self> {
        Arc::new(InFlight { per_client, held: Mutex::default() })
    }

    pub fn enter(self: &Arc<Self>, key: ClientKey) -> Result<Ticket, ApiError> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let mine = held.entry(key.clone()).or_default();
        if *mine >= self.per_client {
            return Err(ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                kind: "rate_limit_error",
                code: "too_many_requests_in_flight".into(),
                param: None,
                message: format!(
                    "This client already has {} requests in flight, the most one client may have (--max-requests-per-client); retry when one finishes.",
                    self.per_client
                ),
            });
        }
        *mine += 1;
        Ok(Ticket { owner: self.clone(), key })
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut held = self.owner.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = held.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.key);
            }
        }
    }
}

/// Middleware for generating routes: a ticket per request, held by the response body.
pub async fn limit(State(in_flight): State<Arc<InFlight>>, req: Request, next: Next) -> Response {
    let ticket = match in_flight.enter(ClientKey::of(&req)) {
        Ok(t) => t,
        Err(e) => return e.into_response(),
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
    fn a_client_gets_its_share_and_others_are_not_affected() {
        let f = InFlight::new(2);
        let a = ClientKey::Addr("10.0.0.1".parse().unwrap());
        let t1 = f.enter(a.clone()).unwrap();
        let _t2 = f.enter(a.clone()).unwrap();
        let refused = f.enter(a.clone()).unwrap_err();
        assert_eq!((refused.status, refused.code.as_str()), (StatusCode::TOO_MANY_REQUESTS, "too_many_requests_in_flight"));
        assert!(f.enter(ClientKey::ApiKey([1; 32])).is_ok(), "another client is not limited by this one");
        drop(t1);
        assert!(f.enter(a).is_ok(), "a finished request gives its place back");
    }
}
