//! How every kvgate process logs and traces. One place, so the worker roles, the operator and the
//! test node agent write the same shapes: human text on a terminal, flat JSON lines with trace
//! ids for a cluster's log pipeline (`json_lines`), never colour escapes where no terminal reads
//! them (`kubectl logs`), and OpenTelemetry spans when an OTLP endpoint is configured
//! (`export`, `trace_context`).

pub mod export;
mod json_lines;
pub mod trace_context;

pub use export::Traces;
pub use trace_context::{TRACEPARENT, TraceContext};

use std::io::IsTerminal;
use std::sync::OnceLock;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The shape of log lines (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// One line of text per event; coloured only when the stream is a terminal.
    #[default]
    Text,
    /// One flat JSON object per line: `timestamp`, `level`, `target`, `message`, the event's
    /// fields, `span` and the fields of the spans it happened in (`trace_id`, `span_id`,
    /// `request_id`, `handoff_id` on a request's lines).
    Json,
}

impl LogFormat {
    /// The flag's value: `text` or `json`.
    pub fn as_str(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

/// The environment variable every kvgate binary reads `--log-format` from.
pub const LOG_FORMAT_ENV: &str = "KVGATE_LOG_FORMAT";

static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// Installs the global subscriber writing to stderr, exporting spans as `service` when the
/// `OTEL_*` variables ask for it (`export`). `RUST_LOG` overrides `default_filter`. Keep the
/// returned guard until the end of `main`: dropping it sends the spans still queued.
pub fn init(format: LogFormat, default_filter: &str, service: &str) -> Traces {
    let stderr = std::io::stderr();
    let ansi = stderr.is_terminal();
    let _ = FORMAT.set(format);
    let (otel, traces) = match export::layer(service) {
        Ok(ok) => ok,
        Err(why) => {
            eprintln!("{service}: traces are not exported: {why}");
            (None, Traces::none())
        }
    };
    install(format, default_filter, ansi, std::io::stderr, otel);
    traces
}

/// Why the process exits: a plain line on stderr with text logs, an error event with JSON logs
/// (so every line a pod writes parses).
pub fn fatal(line: &str) {
    match FORMAT.get() {
        Some(LogFormat::Json) => tracing::error!("{line}"),
        _ => eprintln!("{line}"),
    }
}

/// A start-up line (`... listening on http://...`): a plain line on stdout for people and
/// scripts with text logs, a log event like every other line with JSON logs.
pub fn announce(line: &str) {
    match FORMAT.get() {
        Some(LogFormat::Json) => tracing::info!("{line}"),
        _ => println!("{line}"),
    }
}

type Registry = tracing_subscriber::layer::Layered<EnvFilter, tracing_subscriber::Registry>;

fn install<W>(format: LogFormat, default_filter: &str, ansi: bool, writer: W, otel: Option<export::Layer<Registry>>)
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into());
    let base = tracing_subscriber::registry().with(filter);
    let fmt = tracing_subscriber::fmt::layer().with_writer(writer);
    match format {
        LogFormat::Text => base.with(otel).with(fmt.with_ansi(ansi)).init(),
        LogFormat::Json => base.with(otel).with(fmt.fmt_fields(tracing_subscriber::fmt::format::JsonFields::new()).event_format(json_lines::JsonLines)).init(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Buffer {
        type Writer = Buffer;
        fn make_writer(&'a self) -> Self::Writer {
            self.clone()
        }
    }

    // One global subscriber per process: the JSON shape is checked here, the text shape (no
    // escapes off a terminal) end to end against the real binaries.
    #[test]
    fn json_lines_carry_level_message_fields_and_span() {
        let buf = Buffer::default();
        install(LogFormat::Json, "info", false, buf.clone(), None);
        let request = tracing::info_span!("request", request_id = "r-1", trace_id = tracing::field::Empty, span_id = tracing::field::Empty);
        let here = trace_context::adopt(&request, None);
        let handoff = request.in_scope(|| tracing::info_span!("handoff_receive", handoff_id = "h-7"));
        handoff.in_scope(|| tracing::warn!(pages = 3, "handoff refused"));
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        let line: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(line["level"], "WARN");
        assert_eq!(line["message"], "handoff refused");
        assert_eq!(line["pages"], 3);
        assert_eq!(line["span"], "handoff_receive");
        assert_eq!(line["request_id"], "r-1");
        assert_eq!(line["handoff_id"], "h-7");
        assert_eq!(line["trace_id"], here.trace_id_hex());
        assert_eq!(line["span_id"], here.span_id_hex());
        assert!(line["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')), "{line}");
        assert!(!text.contains('\x1b'), "{text:?}");
    }
}
