//! W3C trace context: the `traceparent` a client sends, a role hands to its peers (inside the
//! signed body) and the handoff carries. A request always has one, exported or not, so its log
//! lines carry the same `trace_id` in every pod; with an OTLP endpoint configured (`export`) the
//! ids are the exported spans' own.

use std::fmt;

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The header a caller names its trace in (<https://www.w3.org/TR/trace-context/>).
pub const TRACEPARENT: &str = "traceparent";

/// One position in a trace: the trace and the span a call comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: u128,
    pub span_id: u64,
    pub sampled: bool,
}

impl TraceContext {
    /// A `traceparent` value: `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`. Higher
    /// versions are read by the same prefix, as the spec asks; all-zero ids, upper-case hex and
    /// version `ff` are refused.
    pub fn parse(value: &str) -> Option<TraceContext> {
        let value = value.trim();
        let mut parts = value.splitn(5, '-');
        let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let rest_ok = match version {
            "00" => parts.next().is_none(),
            _ => true,
        };
        let lower_hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !rest_ok || !lower_hex(version, 2) || version == "ff" || !lower_hex(trace, 32) || !lower_hex(span, 16) || !lower_hex(flags, 2) {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok().filter(|t| *t != 0)?;
        let span_id = u64::from_str_radix(span, 16).ok().filter(|s| *s != 0)?;
        let sampled = u8::from_str_radix(flags, 16).ok()? & 1 == 1;
        Some(TraceContext { trace_id, span_id, sampled })
    }

    /// A new trace (a request that came without one).
    pub fn root() -> TraceContext {
        TraceContext { trace_id: nonzero(rand::random()), span_id: nonzero(rand::random()), sampled: true }
    }

    /// A new span of the same trace.
    pub fn child(&self) -> TraceContext {
        TraceContext { span_id: nonzero(rand::random()), ..*self }
    }

    pub fn trace_id_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    pub fn span_id_hex(&self) -> String {
        format!("{:016x}", self.span_id)
    }

    fn of(span: &SpanContext) -> Option<TraceContext> {
        span.is_valid().then(|| TraceContext {
            trace_id: u128::from_be_bytes(span.trace_id().to_bytes()),
            span_id: u64::from_be_bytes(span.span_id().to_bytes()),
            sampled: span.is_sampled(),
        })
    }

    fn remote(&self) -> opentelemetry::Context {
        let flags = if self.sampled { TraceFlags::SAMPLED } else { TraceFlags::default() };
        let span = SpanContext::new(
            TraceId::from_bytes(self.trace_id.to_be_bytes()),
            SpanId::from_bytes(self.span_id.to_be_bytes()),
            flags,
            true,
            TraceState::default(),
        );
        opentelemetry::Context::new().with_remote_span_context(span)
    }
}

/// The `traceparent` value.
impl fmt::Display for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "00-{:032x}-{:016x}-{:02x}", self.trace_id, self.span_id, u8::from(self.sampled))
    }
}

fn nonzero<T: Default + PartialEq + From<u8>>(v: T) -> T {
    if v == T::default() { T::from(1) } else { v }
}

/// Makes `span` a request's local root: a child of `parent` (the caller's `traceparent`) or the
/// root of a new trace. Records `trace_id` and `span_id` on it (declare both as
/// `tracing::field::Empty`) and returns its position, which calls made under it hand on.
pub fn adopt(span: &tracing::Span, parent: Option<TraceContext>) -> TraceContext {
    let here = if crate::export::enabled() {
        if let Some(parent) = parent {
            let _ = span.set_parent(parent.remote());
        }
        TraceContext::of(span.context().span().span_context())
    } else {
        None
    };
    let here = here.unwrap_or_else(|| parent.map_or_else(TraceContext::root, |p| p.child()));
    span.record("trace_id", here.trace_id_hex());
    span.record("span_id", here.span_id_hex());
    here
}

/// Marks `span` failed (it declares `otel.status_code`, `otel.status_description` and
/// `error.type`) with `reason`: a refused handoff names its mismatch, a failed reconcile its
/// error. `error.type` (the OpenTelemetry convention for an error's class) is an attribute, so a
/// trace search can match it; the status is not one.
pub fn mark_failed(span: &tracing::Span, reason: &str) {
    span.record("otel.status_code", "error");
    span.record("otel.status_description", reason);
    span.record("error.type", reason);
}

/// The current span's position, when spans are exported (a process that starts no request,
/// like the operator, has a trace only then).
pub fn current() -> Option<TraceContext> {
    if !crate::export::enabled() {
        return None;
    }
    TraceContext::of(tracing::Span::current().context().span().span_context())
}

/// The position a call made now hands on: the current span's, when spans are exported (so the
/// callee's spans hang under the exact span that called), else `fallback`.
pub fn outgoing(fallback: &TraceContext) -> TraceContext {
    current().unwrap_or(*fallback)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_round_trips_and_bad_ones_are_refused() {
        let v = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let t = TraceContext::parse(v).unwrap();
        assert_eq!(t.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.span_id_hex(), "00f067aa0ba902b7");
        assert!(t.sampled);
        assert_eq!(t.to_string(), v);
        assert!(!TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap().sampled);
        // A later version may append fields.
        assert!(TraceContext::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra").is_some());
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn without_export_a_span_joins_its_callers_trace_under_a_new_span_id() {
        let parent = TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        let span = tracing::info_span!("request", trace_id = tracing::field::Empty, span_id = tracing::field::Empty);
        let here = adopt(&span, Some(parent));
        assert_eq!(here.trace_id, parent.trace_id);
        assert_ne!(here.span_id, parent.span_id);
        assert_eq!(outgoing(&here), here);
        let fresh = adopt(&span, None);
        assert_ne!(fresh.trace_id, parent.trace_id);
    }
}
