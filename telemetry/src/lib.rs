//! How every kvgate process logs. One place, so the worker roles, the operator and the test node
//! agent write the same shapes: human text on a terminal, JSON lines for a cluster's log
//! pipeline, and never colour escapes where no terminal reads them (`kubectl logs`). And one
//! piece of process hygiene every long-running kvgate process shares: freed memory goes back
//! to the OS (`memory`).

mod memory;
pub use memory::give_back_freed_memory;

use std::io::IsTerminal;
use std::sync::OnceLock;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

/// The shape of log lines (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// One line of text per event; coloured only when the stream is a terminal.
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `fields` (with `message`) and
    /// the current `span`/`spans`.
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

/// Installs the global subscriber writing to stderr. `RUST_LOG` overrides `default_filter`.
pub fn init(format: LogFormat, default_filter: &str) {
    let stderr = std::io::stderr();
    let ansi = stderr.is_terminal();
    let _ = FORMAT.set(format);
    install(format, default_filter, ansi, std::io::stderr);
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

fn install<W>(format: LogFormat, default_filter: &str, ansi: bool, writer: W)
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(writer);
    match format {
        LogFormat::Text => builder.with_ansi(ansi).init(),
        LogFormat::Json => builder.json().with_current_span(true).with_span_list(true).init(),
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
        install(LogFormat::Json, "info", false, buf.clone());
        let span = tracing::info_span!("request", request_id = "r-1");
        span.in_scope(|| tracing::warn!(pages = 3, "handoff refused"));
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        let line: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(line["level"], "WARN");
        assert_eq!(line["fields"]["message"], "handoff refused");
        assert_eq!(line["fields"]["pages"], 3);
        assert_eq!(line["span"]["request_id"], "r-1");
        assert!(!text.contains('\x1b'), "{text:?}");
    }
}
