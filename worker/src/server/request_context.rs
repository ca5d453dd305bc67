//! Who a public request is, for logs and traces: its id (the client's `x-request-id`, or a new
//! one) and its place in a trace (the client's `traceparent`, or a new trace). Both come back
//! as response headers, and the request's span records them, so every line logged on the
//! request's behalf (here and, through the router's calls, on prefill and decode) carries the
//! same `trace_id`, `span_id` and `request_id`.

use axum::extract::Request;
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use kvgate_telemetry::{TRACEPARENT, TraceContext, trace_context};
use tracing::Instrument;
use tracing::field::Empty;

/// The header a request id comes in and goes back out in.
pub const REQUEST_ID: &str = "x-request-id";

/// Longest client request id kept (a longer or non-printable one is replaced by a new id).
const MAX_REQUEST_ID: usize = 128;

/// One public request's identity, handed to whatever serves it.
#[derive(Debug, Clone)]
pub struct RequestContext {
    pub id: String,
    pub trace: TraceContext,
    /// When it arrived (time to first token is counted from here).
    pub started: std::time::Instant,
    /// Whose request it is (set by `tenants::identify`): the unit of quota and fairness, and
    /// what its reservation and KV are bound to on prefill and decode.
    pub tenant: crate::tenants::Tenant,
    /// How its answer reaches the client (set once the body is parsed).
    pub delivery: Delivery,
}

/// How a request's tokens reach its client: as they come, or all at once when generation is
/// done. A peer that fails before the client saw anything may be retried on another pair: for a
/// held answer, that is any time before it is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    Streamed,
    Held,
}

impl RequestContext {
    /// The `traceparent` a call made now on this request's behalf carries.
    pub fn traceparent(&self) -> String {
        trace_context::outgoing(&self.trace).to_string()
    }
}

fn client_id(req: &Request) -> Option<String> {
    let id = req.headers().get(REQUEST_ID)?.to_str().ok()?;
    (!id.is_empty() && id.len() <= MAX_REQUEST_ID && id.bytes().all(|b| b.is_ascii_graphic())).then(|| id.to_string())
}

fn new_id() -> String {
    format!("req-{:032x}", rand::random::<u128>())
}

/// Middleware of the public routes with a body: opens the request's span, hands its context to
/// the handler, and returns its id and trace position as headers.
pub async fn open(mut req: Request, next: Next) -> Response {
    let id = client_id(&req).unwrap_or_else(new_id);
    let parent = req.headers().get(TRACEPARENT).and_then(|v| v.to_str().ok()).and_then(TraceContext::parse);
    let span = tracing::info_span!(
        "request",
        otel.kind = "server",
        otel.name = %format!("{} {}", req.method(), req.uri().path()),
        otel.status_code = Empty,
        otel.status_description = Empty, error.type = Empty,
        http.route = req.uri().path(),
        request_id = %id,
        tenant = Empty,
        trace_id = Empty,
        span_id = Empty,
        gen_ai.operation.name = Empty,
        gen_ai.request.model = Empty,
        gen_ai.request.max_tokens = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        gen_ai.response.finish_reasons = Empty,
        gen_ai.server.time_to_first_token = Empty,
        http.response.status_code = Empty,
        error.type = Empty,
    );
    let trace = trace_context::adopt(&span, parent);
    let started = std::time::Instant::now();
    req.extensions_mut().insert(RequestContext { id: id.clone(), trace, started, tenant: crate::tenants::Tenant::Unknown, delivery: Delivery::Streamed });
    let mut resp = next.run(req).instrument(span.clone()).await;
    let status = resp.status();
    span.record("http.response.status_code", i64::from(status.as_u16()));
    // The access line: the one place a request's id, trace id and outcome meet in the log.
    let elapsed_ms = started.elapsed().as_millis() as u64;
    span.in_scope(|| tracing::info!(status = status.as_u16(), elapsed_ms, "request answered"));
    if status.is_server_error() {
        trace_context::mark_failed(&span, status.as_str());
        span.record("error.type", status.as_str());
    }
    let headers = resp.headers_mut();
    headers.insert(REQUEST_ID, HeaderValue::from_str(&id).expect("checked printable ASCII"));
    headers.insert(TRACEPARENT, HeaderValue::from_str(&trace.to_string()).expect("hex and dashes"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_id(id: &str) -> Request {
        Request::builder().header(REQUEST_ID, id).body(axum::body::Body::empty()).unwrap()
    }

    #[test]
    fn a_client_request_id_is_kept_when_printable_and_short() {
        assert_eq!(client_id(&with_id("abc-123")).as_deref(), Some("abc-123"));
        assert_eq!(client_id(&with_id("has space")), None);
        assert_eq!(client_id(&with_id(&"x".repeat(MAX_REQUEST_ID + 1))), None);
        assert!(new_id().starts_with("req-"));
    }
}
