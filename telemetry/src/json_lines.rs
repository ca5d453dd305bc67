//! JSON log lines a log pipeline can index without unpacking: one flat object per event with
//! `timestamp`, `level`, `target`, `message`, the event's fields, `span` (the innermost span's
//! name) and the fields of every span the event happened in. A request's span records
//! `trace_id`, `span_id` and `request_id`, a handoff's `handoff_id`, so every line written on a
//! request's behalf carries them at the top level, where `jq 'select(.trace_id == "...")'` or
//! Loki's `| json | trace_id="..."` finds them.

use std::fmt;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// The event formatter of `--log-format json` (span fields are kept by `JsonFields`).
pub struct JsonLines;

impl<S> FormatEvent<S, JsonFields> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, JsonFields>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let mut line = Map::new();
        let mut timestamp = String::new();
        SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        line.insert("timestamp".into(), timestamp.into());
        let meta = event.metadata();
        line.insert("level".into(), meta.level().as_str().into());
        line.insert("target".into(), meta.target().into());
        if let Some(scope) = ctx.event_scope() {
            let mut innermost = None;
            for span in scope.from_root() {
                if let Some(Ok(Value::Object(fields))) = span.extensions().get::<FormattedFields<JsonFields>>().map(|f| serde_json::from_str::<Value>(f)) {
                    // `otel.*` fields steer the exported span (name, kind, status), not the log.
                    line.extend(fields.into_iter().filter(|(k, _)| !k.starts_with("otel.")));
                }
                innermost = Some(span.name());
            }
            line.extend(innermost.map(|name| ("span".to_string(), Value::from(name))));
        }
        event.record(&mut Fields(&mut line));
        writeln!(writer, "{}", Value::Object(line))
    }
}

/// Writes an event's fields into the line (over any span field of the same name).
struct Fields<'a>(&'a mut Map<String, Value>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0.insert(field.name().into(), value.to_string().into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().into(), format!("{value:?}").into());
    }
}
