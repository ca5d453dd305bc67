//! The worker's Prometheus metrics. Base units, `_total` counters, bounded labels; every known
//! label value starts at zero so rates and alerts work from the first scrape.

use prometheus::{Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};

/// Why the engine turns a request away before generating (`engine::admission::Rejection`):
/// the reasons `kvgate_requests_rejected_total` counts, each from zero.
pub const REJECTION_REASONS: [&str; 4] = ["context_length_exceeded", "prompt_too_large", "pool_busy", "invalid_request"];

/// HTTP status codes the worker answers with (the `code` label).
pub const CODES: [&str; 11] = ["200", "400", "401", "404", "408", "413", "429", "500", "502", "503", "504"];

/// What every serving role exports: requests, rejections, latencies, tokens.
#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    pub role: String,
    pub context_window_tokens: IntGauge,
    pub requests: IntCounterVec,
    pub rejected: IntCounterVec,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub duration: Histogram,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    /// Requests whose client left before the answer: their work was cancelled.
    pub abandoned: IntCounter,
    /// Requests being served now (an engine's running sequences, a router's dispatches), and
    /// requests queued for admission: what an endpoint picker scores a pod by.
    pub running: IntGauge,
    pub waiting: IntGauge,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

/// Registers one role's metrics: every series carries the constant label `role`, and every
/// known label value of a counter family starts at zero.
#[derive(Clone, Copy)]
pub struct RoleRegistry<'a> {
    pub registry: &'a Registry,
    pub role: &'a str,
}

impl RoleRegistry<'_> {
    fn opts(&self, name: &str, help: &str) -> Opts {
        Opts::new(name, help).const_label("role", self.role)
    }

    fn register<M: prometheus::core::Collector + Clone + 'static>(&self, m: M) -> M {
        self.registry.register(Box::new(m.clone())).unwrap();
        m
    }

    pub fn gauge(&self, name: &str, help: &str) -> IntGauge {
        self.register(IntGauge::with_opts(self.opts(name, help)).unwrap())
    }

    pub fn ratio(&self, name: &str, help: &str) -> Gauge {
        self.register(Gauge::with_opts(self.opts(name, help)).unwrap())
    }

    pub fn counter(&self, name: &str, help: &str) -> IntCounter {
        self.register(IntCounter::with_opts(self.opts(name, help)).unwrap())
    }

    pub fn counter_vec(&self, name: &str, help: &str, label: &str, values: &[&str]) -> IntCounterVec {
        let c = IntCounterVec::new(self.opts(name, help), &[label]).unwrap();
        for v in values {
            c.with_label_values(&[*v]);
        }
        self.register(c)
    }

    /// A counter family over two labels, every pair of known values starting at zero.
    pub fn counter_grid(&self, name: &str, help: &str, labels: [&str; 2], rows: &[&str], columns: &[&str]) -> IntCounterVec {
        let c = IntCounterVec::new(self.opts(name, help), &labels).unwrap();
        for r in rows {
            for col in columns {
                c.with_label_values(&[*r, *col]);
            }
        }
        self.register(c)
    }

    pub fn histogram(&self, name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
        let opts = HistogramOpts::new(name, help).const_label("role", self.role).buckets(buckets);
        self.register(Histogram::with_opts(opts).unwrap())
    }
}

impl Metrics {
    /// Metrics for one worker role, registered in `registry` (roles of one process share it).
    pub fn new(registry: &Registry, role: &str) -> Self {
        let r = RoleRegistry { registry, role };
        let latency = || prometheus::exponential_buckets(0.001, 2.0, 16).unwrap();
        Metrics {
            registry: registry.clone(),
            role: role.to_string(),
            context_window_tokens: r.gauge("kvgate_context_window_tokens", "Declared context window, in tokens."),
            requests: r.counter_vec("kvgate_requests_total", "Completion requests answered, by HTTP status code.", "code", &CODES),
            rejected: r.counter_vec("kvgate_requests_rejected_total", "Requests rejected before generation, by reason.", "reason", &REJECTION_REASONS),
            abandoned: r.counter(
                "kvgate_requests_abandoned_total",
                "Requests whose client disconnected before the answer; their prefill, reservation and decode were cancelled.",
            ),
            ttft: r.histogram("kvgate_time_to_first_token_seconds", "Time from request arrival to its first generated token.", latency()),
            inter_token: r.histogram("kvgate_inter_token_latency_seconds", "Time between consecutive generated tokens of one request.", latency()),
            duration: r.histogram(
                "kvgate_request_duration_seconds",
                "Time from request arrival to its last token.",
                prometheus::exponential_buckets(0.005, 2.0, 16).unwrap(),
            ),
            prompt_tokens: r.counter("kvgate_prompt_tokens_total", "Prompt tokens of admitted requests."),
            running: r.gauge("kvgate_num_requests_running", "Requests being served now: an engine's running sequences, a router's dispatches in flight."),
            waiting: r.gauge("kvgate_num_requests_waiting", "Requests queued for admission (waiting for KV pages); a router queues none."),
            generation_tokens: r.counter("kvgate_generation_tokens_total", "Tokens generated."),
        }
    }
}

/// The KV pool's gauges, for roles that hold a pool (not the router).
#[derive(Clone)]
pub struct PoolGauges {
    pub capacity_tokens: IntGauge,
    pub used_tokens: IntGauge,
    pub pages: IntGauge,
    pub pages_in_use: IntGauge,
    pub usage_ratio: Gauge,
}

impl PoolGauges {
    /// The gauges the pool keeps up to date itself.
    pub fn usage(&self) -> crate::kv::pool::UsageGauges {
        crate::kv::pool::UsageGauges { pages_in_use: self.pages_in_use.clone(), used_tokens: self.used_tokens.clone(), usage_ratio: self.usage_ratio.clone() }
    }

    pub fn new(registry: &Registry, role: &str) -> Self {
        let r = RoleRegistry { registry, role };
        PoolGauges {
            capacity_tokens: r.gauge("kvgate_kv_pool_capacity_tokens", "Measured KV pool capacity: tokens in the pages really allocated."),
            used_tokens: r.gauge("kvgate_kv_pool_used_tokens", "Tokens of KV pool capacity held by live sequences (whole pages)."),
            pages: r.gauge("kvgate_kv_pool_pages", "Pages allocated in the KV pool."),
            pages_in_use: r.gauge("kvgate_kv_pool_pages_in_use", "KV pool pages held by live sequences or reservations."),
            usage_ratio: r.ratio("kvgate_kv_cache_usage_ratio", "Fraction of the KV pool's pages in use (0 to 1), as vLLM's kv_cache_usage_perc."),
        }
    }
}

/// `kvgate_build_info`, once per process.
pub fn register_build_info(registry: &Registry) {
    let g = IntGaugeVec::new(Opts::new("kvgate_build_info", "Build of this kvgate binary (always 1)."), &["version", "component"]).unwrap();
    g.with_label_values(&[env!("CARGO_PKG_VERSION"), "worker"]).set(1);
    registry.register(Box::new(g)).unwrap();
}

/// The text exposition of everything in `registry`.
pub fn render(registry: &Registry) -> String {
    let mut buf = Vec::new();
    TextEncoder::new().encode(&registry.gather(), &mut buf).unwrap();
    String::from_utf8(buf).unwrap()
}
