//! The public routes' door: each request is given its tenant (`tenants::Auth::identify`) in
//! its request context and its span, and its answer is counted by tenant; a request
//! with none gets 401 in OpenAI's shape with `WWW-Authenticate: Bearer`.

use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::{AppState, RequestContext};
use crate::listener::ClientAddr;

/// Middleware: the request's [`Tenant`] into its extensions and span, its answer counted by
/// tenant; a 401 for a request with none.
pub async fn identify(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let addr = req.extensions().get::<ClientAddr>().map(|a| a.0.ip());
    let tenants = state.tenants.clone();
    let tenant = match tenants.auth.identify(req.headers(), addr) {
        Ok(t) => t,
        Err(why) => {
            state.count(401);
            tenants.metrics.refused(None, "unauthenticated");
            tracing::Span::current().record("tenant", "unauthenticated");
            let mut resp = ApiError::from(&why).into_response();
            resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"kvgate\""));
            return resp;
        }
    };
    tracing::Span::current().record("tenant", tracing::field::display(&tenant));
    // The request's context carries it on (routes without one, the listings, need it no further).
    if let Some(context) = req.extensions_mut().get_mut::<RequestContext>() {
        context.tenant = tenant.clone();
    }
    let resp = next.run(req).await;
    tenants.metrics.answered(&tenant, resp.status().as_u16());
    resp
}
