//! Fuzzing the JSON bodies of `/v1/*` and `/internal/*` through the real handlers, in process
//! (proptest; a fixed budget per run: `KVGATE_FUZZ_CASES`, default 512 cases per endpoint group;
//! `make fuzz` runs many more). Internal bodies are signed with the deployment's secret, so they
//! reach the handlers behind the signature check. Properties: no panic, an answer with a known
//! status and a JSON body, and no allocation out of proportion to the body (a counting global
//! allocator measures each request's peak). `KVGATE_FUZZ_TRACE=1` (with `--nocapture`) prints
//! every answer, to see how deep the generated bodies reach.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::body::Body;
use axum::http::Request;
use clap::Parser;
use kvgate_proto::auth::Instance;
use kvgate_worker::cli::{Cli, Command};
use kvgate_worker::commands::roles;
use kvgate_worker::handoff::Secret;
use kvgate_worker::roles::internal_auth::Signer;
use proptest::prelude::*;
use serde_json::{Map, Value};
use tower::ServiceExt;

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// One measurement at a time: the counters are process-wide, and a test that resets `PEAK` while
/// another measures would hide (or add to) that one's allocations.
static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

// SAFETY: every call is passed to `System` unchanged; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn cases() -> u32 {
    std::env::var("KVGATE_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512)
}

/// The three apps under test, built once: a colocated worker (the public API) and a decode and
/// a prefill worker (the internal API), with small windows so admitted requests stay cheap.
struct Apps {
    rt: tokio::runtime::Runtime,
    public: axum::Router,
    decode: axum::Router,
    prefill: axum::Router,
    signer: Signer,
    /// The processes decode's and prefill's signed calls are for (their reports name them).
    decode_is: Instance,
    prefill_is: Instance,
}

/// The instance a role's capacity report names.
async fn instance_of(app: &axum::Router) -> Instance {
    let resp = app.clone().oneshot(Request::get("/v1/kv-pool").body(Body::empty()).unwrap()).await.unwrap();
    let report: serde_json::Value = serde_json::from_slice(&axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap()).unwrap();
    report["instance"].as_str().unwrap().parse().unwrap()
}

fn apps() -> &'static Apps {
    static APPS: OnceLock<Apps> = OnceLock::new();
    APPS.get_or_init(|| {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let secret = Secret::new(b"fuzzing-secret-0123456789").unwrap();
        let parse = |args: &[&str]| Cli::try_parse_from(std::iter::once("kvgate-worker").chain(args.iter().copied())).unwrap().command;
        let small = ["--context-window", "64", "--kv-pool-tokens", "256", "--admission-timeout-ms", "10"];
        let (public, decode, prefill, decode_is, prefill_is) = rt.block_on(async {
            let registry = roles::registry();
            let Command::Local(local) = parse(&[&["local", "--colocated", "--listen", "127.0.0.1:0"][..], &small].concat()) else { unreachable!() };
            let Command::Decode(d) = parse(
                &[
                    &["decode", "--listen", "127.0.0.1:0", "--kv-listen", "127.0.0.1:0", "--handoff-timeout-ms", "200", "--max-open-reservations", "8"][..],
                    &small,
                ]
                .concat(),
            ) else {
                unreachable!()
            };
            let Command::Prefill(p) = parse(&[&["prefill", "--listen", "127.0.0.1:0"][..], &small].concat()) else { unreachable!() };
            let public = roles::colocated(&local, &registry).await.unwrap().app;
            let decode = roles::decode(&d, &roles::registry(), secret.clone()).await.unwrap().app;
            let prefill = roles::prefill(&p, &roles::registry(), secret.clone(), false).await.unwrap().app;
            let (decode_is, prefill_is) = (instance_of(&decode).await, instance_of(&prefill).await);
            (public, decode, prefill, decode_is, prefill_is)
        });
        Apps { rt, public, decode, prefill, signer: Signer::new(&secret), decode_is, prefill_is }
    })
}

/// Sends one POST and checks the answer; returns the request's peak allocation beyond what
/// was live before it.
fn post(app: &axum::Router, path: &str, body: Vec<u8>, signer: Option<(&Signer, Instance)>) -> Result<usize, TestCaseError> {
    let a = apps();
    let mut req = Request::post(path).header("content-type", "application/json");
    if let Some((s, target)) = signer {
        req = req.header("x-kvgate-signature", s.sign(path, target, &body));
    }
    let req = req.body(Body::from(body)).unwrap();
    let measuring = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let (status, kind, bytes) = a.rt.block_on(async {
        let resp = app.clone().oneshot(req).await.unwrap();
        let status = resp.status().as_u16();
        let kind = resp.headers().get("content-type").map(|v| v.to_str().unwrap_or("").to_string()).unwrap_or_default();
        (status, kind, axum::body::to_bytes(resp.into_body(), 1 << 24).await.unwrap())
    });
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    drop(measuring);
    if std::env::var_os("KVGATE_FUZZ_TRACE").is_some() {
        eprintln!("{status} {path} {}", String::from_utf8_lossy(&bytes[..bytes.len().min(300)]));
    }
    let text = String::from_utf8_lossy(&bytes);
    prop_assert!([200, 400, 401, 404, 413, 502, 503].contains(&status), "{path}: status {status}: {text}");
    // Whole answers are one JSON document; streams are JSON per event (SSE) or per line (NDJSON).
    let documents: Vec<&str> = match kind.as_str() {
        "text/event-stream" => text.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]").collect(),
        "application/x-ndjson" => text.lines().collect(),
        _ => vec![&text],
    };
    for d in documents {
        prop_assert!(serde_json::from_str::<Value>(d).is_ok(), "{path}: {status} ({kind}) answered non-JSON: {d}");
    }
    Ok(peak)
}

/// Keys the endpoints know, so generated objects often reach deep into the validation.
const KEYS: [&str; 30] = [
    "prompt",
    "stop",
    "logprobs",
    "top_logprobs",
    "echo",
    "stream_options",
    "tokens",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stream",
    "n",
    "model",
    "messages",
    "role",
    "content",
    "type",
    "text",
    "prompt_tokens",
    "reservation",
    "handoff_id",
    "pages",
    "reserved_tokens",
    "expires_ms",
    "tag",
    "rejected",
    "sampling",
    "commit_wait_ms",
];

fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u32>().prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "[ -~]{0,24}".prop_map(Value::String),
        prop_oneof![Just("user"), Just("system"), Just("text"), Just("tiny"), Just("0123456789abcdef0123456789abcdef")].prop_map(|s| Value::String(s.into())),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::vec((proptest::sample::select(&KEYS[..]), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect::<Map<_, _>>())),
        ]
    })
}

/// A number as a client might send one: small, at a limit, huge, negative or fractional.
fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        6 => (1..40u64).prop_map(Value::from),
        1 => Just(Value::from(0)),
        1 => Just(Value::from(u32::MAX)),
        1 => Just(Value::from(u64::MAX)),
        1 => any::<i32>().prop_map(Value::from),
        1 => (-3.0..3.0f64).prop_map(Value::from),
    ]
}

fn temperature() -> impl Strategy<Value = Value> {
    prop_oneof![4 => (0.0..2.0f64).prop_map(Value::from), 1 => number()]
}

/// Bodies shaped like real requests of every endpoint, with values pushed to and past their
/// limits: these get past parsing into the handlers' own checks, and some are served.
fn shaped() -> impl Strategy<Value = Value> {
    let text = "[ -~]{0,40}";
    let ids = proptest::collection::vec(prop_oneof![0..300u32, Just(u32::MAX)], 0..12);
    prop_oneof![
        (text, number(), temperature(), any::<bool>()).prop_map(|(p, m, t, stream)| serde_json::json!({"prompt": p, "max_tokens": m, "temperature": t, "stream": stream})),
        (text, number()).prop_map(|(p, m)| serde_json::json!({"messages": [{"role": "user", "content": p}], "max_tokens": m})),
        (number(), number()).prop_map(|(p, m)| serde_json::json!({"prompt_tokens": p, "max_tokens": m, "tenant": "acme"})),
        (ids.clone(), number(), number()).prop_map(|(ids, m, w)| serde_json::json!({"prompt": ids, "tenant": "fuzz", "max_tokens": m, "sampling": {"temperature": 0.0, "top_p": 1.0, "seed": null}, "commit_wait_ms": w})),
        (ids, number()).prop_map(|(ids, n)| serde_json::json!({"prompt": ids, "tenant": "fuzz", "reservation": {"handoff_id": "0123456789abcdef0123456789abcdef", "pages": [0], "reserved_tokens": n, "max_tokens": 1, "expires_ms": n, "tag": "00", "kv_addr": "127.0.0.1:9", "model_fingerprint": "0", "layout_fingerprint": "0", "tenant": "fuzz"}})),
        any::<bool>().prop_map(|r| serde_json::json!({"rejected": r})),
    ]
}

/// A body: a request-shaped value, any JSON value, or bytes that are not JSON at all.
fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        5 => shaped().prop_map(|v| serde_json::to_vec(&v).unwrap()),
        2 => json().prop_map(|v| serde_json::to_vec(&v).unwrap()),
        1 => proptest::collection::vec(any::<u8>(), 0..256),
    ]
}

/// Bounded allocation: the body's size many times over, plus the fixed cost of one request
/// (the tiny model's step included), never anything a number inside the body asks for.
fn bounded(peak: usize, body_len: usize) -> bool {
    peak <= 32 * body_len + (48 << 20)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn public_bodies_never_panic_or_allocate_without_bound(body in body(), chat in any::<bool>()) {
        let a = apps();
        let path = if chat { "/v1/chat/completions" } else { "/v1/completions" };
        let len = body.len();
        let peak = post(&a.public, path, body, None)?;
        prop_assert!(bounded(peak, len), "{path}: {peak} bytes for a {len}-byte body");
    }

    #[test]
    fn internal_bodies_never_panic_or_allocate_without_bound(body in body(), which in 0..4usize, id in "[0-9a-f]{32}") {
        let a = apps();
        let (app, target, path) = match which {
            0 => (&a.decode, a.decode_is, "/internal/v1/reserve".to_string()),
            1 => (&a.decode, a.decode_is, format!("/internal/v1/handoffs/{id}/cancel")),
            2 => (&a.decode, a.decode_is, format!("/internal/v1/handoffs/{id}/generate")),
            _ => (&a.prefill, a.prefill_is, "/internal/v1/prefill".to_string()),
        };
        let len = body.len();
        let peak = post(app, &path, body, Some((&a.signer, target)))?;
        prop_assert!(bounded(peak, len), "{path}: {peak} bytes for a {len}-byte body");
    }
}

#[test]
fn the_allocation_counter_sees_allocations() {
    // A bound nothing can exceed proves nothing: the counter must see a 1 MiB allocation.
    let measuring = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let big = std::hint::black_box(vec![7u8; 1 << 20]);
    let seen = PEAK.load(Ordering::Relaxed) - base;
    drop((big, measuring));
    assert!(seen >= 1 << 20, "the allocator counted nothing");
    // And a body that asks for the largest reservation allocates nothing for it.
    let a = apps();
    let body = serde_json::to_vec(&serde_json::json!({"prompt_tokens": u32::MAX, "max_tokens": u32::MAX, "tenant": "acme"})).unwrap();
    let peak = post(&a.decode, "/internal/v1/reserve", body.clone(), Some((&a.signer, a.decode_is))).unwrap();
    assert!(bounded(peak, body.len()), "{peak}");
}
