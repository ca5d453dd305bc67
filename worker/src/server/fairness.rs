//! Per-tenant fairness on the public API: one tenant (see `tenants`: proven by an API key or a
//! trusted gateway, else the client's address) has at most so many requests in flight; more
//! are answered 429 at once, so a greedy tenant cannot hold the whole pool while others wait.
//! A request counts until its response body is finished or dropped (a streaming answer counts
//! for as long as it streams).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

use super::AppState;
use super::error::ApiError;
use super::shares::Shares;
use crate::tenants::Tenant;

/// Requests in flight per tenant.
pub type InFlight = Shares<Tenant>;

/// Most requests in flight per tenant, with no total (the pool's admission bounds that).
pub fn in_flight(per_tenant: usize) -> Arc<InFlight> {
    Shares::new(per_tenant)
}

fn refused(tenant: &Tenant, per_tenant: usize) -> ApiError {
    ApiError {
        status: StatusCode::TOO_MANY_REQUESTS,
        kind: "rate_limit_error",
        code: kvgate_proto::codes::ErrorCode::TooManyRequestsInFlight,
        param: None,
        message: format!(
            "Tenant `{tenant}` already has {per_tenant} requests in flight, the most one tenant may have (--max-requests-per-client); retry when one finishes."
        ),
    }
}

/// Middleware for generating routes (after `tenants::identify`): a ticket per request, held by
/// the response body.
pub async fn limit(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let tenant = req.extensions().get::<super::RequestContext>().map_or(Tenant::Unknown, |c| c.tenant.clone());
    let Ok(ticket) = state.in_flight.take(tenant.clone()) else {
        state.count(429);
        state.tenants.metrics.refused(Some(&tenant), "in_flight");
        return refused(&tenant, state.in_flight.per_key()).into_response();
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
    fn the_refusal_names_the_tenant_and_its_share() {
        let e = refused(&Tenant::Addr("10.0.0.1".parse().unwrap()), 16);
        assert_eq!((e.status, e.code), (StatusCode::TOO_MANY_REQUESTS, kvgate_proto::codes::ErrorCode::TooManyRequestsInFlight));
        assert!(e.message.starts_with("Tenant `10.0.0.1` already has 16 requests in flight"), "{}", e.message);
    }
}
