//! The three worker roles of a disaggregated deployment, and the HTTP calls between them.

pub mod decode;
pub mod discovery;
pub mod internal_auth;
pub mod peers;
pub mod prefill;
#[cfg(feature = "testing")]
pub mod prefill_faults;
pub mod prefill_rate;
pub mod retry;
pub mod router;
pub mod router_codes;

/// Internal endpoints (not part of the public API); the operator's canary calls them too.
pub use kvgate_proto::roles::{PREFILL_PATH, RESERVE_PATH, cancel_path, generate_path};

/// Joins an internal call's span (declaring `trace_id` and `span_id`) to its caller's trace,
/// named by the `traceparent` in the signed body; a call without one starts a trace.
pub fn join_trace(span: &tracing::Span, traceparent: Option<&str>) -> kvgate_telemetry::TraceContext {
    kvgate_telemetry::trace_context::adopt(span, traceparent.and_then(kvgate_telemetry::TraceContext::parse))
}
