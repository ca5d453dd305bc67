//! Spans exported over OTLP, configured the way every OpenTelemetry SDK is: on when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) names a collector,
//! off when neither does, or when `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. Off
//! means no OpenTelemetry layer at all: tracing's spans cost what they cost without it.
//! `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER(_ARG)`, `OTEL_BSP_*` and
//! `OTEL_EXPORTER_OTLP_HEADERS`/`_TIMEOUT` are read by the SDK as its spec says. Only
//! `http/protobuf` is built in (OTLP over HTTP, port 4318 of a collector or of Jaeger).

use std::sync::OnceLock;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;

static ENABLED: OnceLock<bool> = OnceLock::new();

/// Whether spans are exported (decided once, by `init`).
pub fn enabled() -> bool {
    *ENABLED.get().unwrap_or(&false)
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

/// Whether the OTEL_* variables ask for export; an error names the variable asking for what
/// kvgate cannot do.
fn configured() -> Result<bool, String> {
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) || var("OTEL_TRACES_EXPORTER").is_some_and(|v| v == "none") {
        return Ok(false);
    }
    if var("OTEL_EXPORTER_OTLP_ENDPOINT").is_none() && var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_none() {
        return Ok(false);
    }
    let protocol = var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL"));
    match protocol.as_deref() {
        None | Some("http/protobuf") => Ok(true),
        Some(other) => Err(format!("OTEL_EXPORTER_OTLP_PROTOCOL={other} is not supported: kvgate exports OTLP over http/protobuf (a collector's port 4318)")),
    }
}

/// The OpenTelemetry layer over subscriber `S`.
pub(crate) type Layer<S> = tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>;

/// Flushes the spans still queued when the process ends (dropped at the end of `main`).
#[must_use = "spans queued at exit are lost unless this lives until the end of main"]
pub struct Traces(Option<SdkTracerProvider>);

impl Traces {
    pub(crate) fn none() -> Traces {
        Traces(None)
    }
}

impl Drop for Traces {
    fn drop(&mut self) {
        if let Some(provider) = self.0.take() {
            let _ = provider.shutdown();
        }
    }
}

/// The OpenTelemetry layer for `service` (unless `OTEL_SERVICE_NAME` names it), or none when
/// export is off. Errors say which variable is wrong.
pub(crate) fn layer<S>(service: &str) -> Result<(Option<Layer<S>>, Traces), String>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    let on = configured()?;
    let _ = ENABLED.set(on);
    if !on {
        return Ok((None, Traces::none()));
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder().with_http().build().map_err(|e| format!("OTLP span exporter: {e}"))?;
    let name = var("OTEL_SERVICE_NAME").unwrap_or_else(|| service.to_string());
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(Resource::builder().with_service_name(name).build()).build();
    let tracer = provider.tracer("kvgate");
    let layer = tracing_opentelemetry::layer().with_tracer(tracer).with_level(true).with_threads(false).with_location(false);
    Ok((Some(layer), Traces(Some(provider))))
}
