//! A real Jaeger (v2, `make tools` builds it from `github.com/jaegertracing/jaeger` v1.76.0)
//! on loopback: OTLP over HTTP in, traces kept in memory, the query API out. Tests point
//! kvgate's processes at `otlp_endpoint` (the standard `OTEL_EXPORTER_OTLP_ENDPOINT`) and read
//! what arrived with `trace`.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::process::{Proc, free_port, tail};
use crate::tools::tool;

pub struct Jaeger {
    proc: Proc,
    /// Where OTLP/HTTP exporters send spans (`OTEL_EXPORTER_OTLP_ENDPOINT`).
    pub otlp_endpoint: String,
    /// The query API and UI (`/api/traces/<id>`, `/search`).
    pub query_url: String,
}

impl Jaeger {
    /// Starts Jaeger with its own loopback ports, writing its config and log into `dir`.
    pub fn start(dir: &Path) -> anyhow::Result<Jaeger> {
        Self::start_receiving_on(dir, "127.0.0.1")
    }

    /// As `start`, with the OTLP receiver on `host`: `0.0.0.0` inside a test world's network
    /// namespace lets its pods export through the fabric (`pods_otlp_endpoint`); the query API
    /// stays on loopback.
    pub fn start_receiving_on(dir: &Path, host: &str) -> anyhow::Result<Jaeger> {
        let bin = tool("jaeger")?;
        std::fs::create_dir_all(dir)?;
        let (otlp, query, query_grpc, health) = (free_port(), free_port(), free_port(), free_port());
        let config = format!(
            r#"service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
extensions:
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 10000
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: 127.0.0.1:{query}
    grpc:
      endpoint: 127.0.0.1:{query_grpc}
  healthcheckv2:
    use_v2: true
    http:
      endpoint: 127.0.0.1:{health}
receivers:
  otlp:
    protocols:
      http:
        endpoint: {host}:{otlp}
processors:
  batch:
    timeout: 100ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"#
        );
        let path = dir.join("jaeger.yaml");
        std::fs::write(&path, config)?;
        let mut proc = Proc::spawn("jaeger", &bin, &[format!("--config={}", path.display())], dir)?;
        let (otlp_endpoint, query_url) = (format!("http://127.0.0.1:{otlp}"), format!("http://127.0.0.1:{query}"));
        let deadline = Instant::now() + Duration::from_secs(60);
        while crate::http::get(&format!("{query_url}/api/services")).is_none() || crate::http::get(&format!("http://127.0.0.1:{health}/status")).is_none() {
            proc.check_alive().map_err(|e| anyhow::anyhow!("{e:#}\n{}", tail(&proc.log, 30)))?;
            anyhow::ensure!(Instant::now() < deadline, "jaeger did not start within 60 s:\n{}", tail(&proc.log, 30));
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(Jaeger { proc, otlp_endpoint, query_url })
    }

    /// Where pods of the test world's nodes send spans: the OTLP port on the world's address on
    /// the fabric (start the receiver on `0.0.0.0`).
    pub fn pods_otlp_endpoint(&self) -> String {
        let port = self.otlp_endpoint.rsplit(':').next().unwrap_or_default();
        format!("http://{}:{port}", crate::fabric::WORLD)
    }

    /// Trace ids of a search of the query API (`/api/traces?<query>`, the UI's `/search`
    /// parameters: service, operation, tags, start, end, minDuration, limit).
    pub fn search(&self, query: &str) -> Vec<String> {
        let body = crate::http::get(&format!("{}/api/traces?{query}", self.query_url)).unwrap_or_default();
        let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        v["data"].as_array().into_iter().flatten().filter_map(|t| t["traceID"].as_str().map(String::from)).collect()
    }

    /// The trace with this id (32 hex digits), as the query API has it now (`None` until any of
    /// its spans arrived): `{"traceID", "spans": [...], "processes": {...}}`.
    pub fn trace(&self, trace_id: &str) -> Option<Value> {
        let body = crate::http::get(&format!("{}/api/traces/{trace_id}", self.query_url))?;
        let v: Value = serde_json::from_str(&body).ok()?;
        v["data"].as_array()?.first().cloned()
    }

    /// Waits up to `within` for the trace to satisfy `done`; the last state seen either way.
    pub fn wait_for(&self, trace_id: &str, within: Duration, done: impl Fn(&Trace) -> bool) -> Trace {
        let deadline = Instant::now() + within;
        loop {
            let t = Trace(self.trace(trace_id).unwrap_or(Value::Null));
            if done(&t) || Instant::now() >= deadline {
                return t;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn log(&self) -> String {
        tail(&self.proc.log, 40)
    }
}

/// A trace as Jaeger's query API returns it.
#[derive(Debug, Clone)]
pub struct Trace(pub Value);

/// One span of a trace, with what tests ask of it.
#[derive(Debug, Clone)]
pub struct Span<'t> {
    pub name: &'t str,
    pub service: &'t str,
    pub raw: &'t Value,
}

impl Span<'_> {
    /// A tag's value (`otel.status_code`, `handoff_id`, ...).
    pub fn tag(&self, key: &str) -> Option<&Value> {
        self.raw["tags"].as_array()?.iter().find(|t| t["key"] == key).map(|t| &t["value"])
    }

    pub fn is_error(&self) -> bool {
        self.tag("error").is_some_and(|v| v == true) || self.tag("otel.status_code").is_some_and(|v| v == "ERROR")
    }
}

impl Trace {
    pub fn spans(&self) -> Vec<Span<'_>> {
        let processes = &self.0["processes"];
        self.0["spans"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| Span {
                name: s["operationName"].as_str().unwrap_or(""),
                service: s["processID"].as_str().and_then(|p| processes[p]["serviceName"].as_str()).unwrap_or(""),
                raw: s,
            })
            .collect()
    }

    pub fn services(&self) -> std::collections::BTreeSet<&str> {
        self.spans().iter().map(|s| s.service).collect()
    }

    /// Whether a span named `name` of service `service` is there.
    pub fn has(&self, service: &str, name: &str) -> bool {
        self.spans().iter().any(|s| s.service == service && s.name == name)
    }

    /// "service/name" of every span, for failure messages.
    pub fn summary(&self) -> Vec<String> {
        self.spans().iter().map(|s| format!("{}/{}{}", s.service, s.name, if s.is_error() { " (error)" } else { "" })).collect()
    }
}
