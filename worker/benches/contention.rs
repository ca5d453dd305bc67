//! One engine under two kinds of interference, each measured side by side with the same engine
//! left alone (`cargo bench -p kvgate-worker --bench contention`, a Markdown table):
//!
//! - eight sequences decoding while 8k-token handoffs keep arriving into the same KV pool through
//!   the real KV port (the decode role's situation): decode tokens/s, and how long a handoff
//!   takes beside the running model against the same handoff with the engine idle;
//! - eight sequences decoding while a 16k-token prompt prefills in the same process: inter-token
//!   latency p50/p99 against the same streams with no prompt, with chunk pacing on (the default,
//!   `--decode-stall-limit 2`) and off (chunks of the whole `--max-batch-tokens`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use candle_core::Device;
use kvgate_worker::engine::{Engine, Event, SchedulerConfig};
use kvgate_worker::kv::{KvDtype, KvPool};
use kvgate_worker::metrics::Metrics;
use kvgate_worker::model::{Model, SamplingParams};
use tokio::sync::Mutex;

#[path = "common/rig.rs"]
mod rig;
use rig::Rig;

const STREAMS: usize = 8;
const WINDOW: usize = 20_000;
/// Each stream's prompt and completion; a finished stream starts another at once.
const PROMPT: usize = 128;
const MAX_TOKENS: usize = 256;
const HANDOFF_TOKENS: usize = 8192;
const LONG_PROMPT: usize = 16_384;

fn engine(stall_limit: f64) -> Engine {
    let model = Arc::new(Model::tiny(&Device::Cpu).unwrap());
    let layout = model.kv_layout(16, KvDtype::F32);
    // The streams, a long prompt and four handoffs in flight, with room to spare.
    let tokens = STREAMS * (PROMPT + MAX_TOKENS) + LONG_PROMPT + 4 * (HANDOFF_TOKENS + 1);
    let pool = KvPool::host(layout, layout.pages_for(tokens) + 64).unwrap();
    let config = SchedulerConfig { max_batch_tokens: 2048, admission_timeout: Duration::from_secs(60), stall_limit };
    Engine::start(model, pool, WINDOW, Metrics::new(&prometheus::Registry::new(), "bench"), config)
}

/// Eight greedy streams that keep decoding until stopped; every token's arrival time, per stream.
struct Streams {
    stop: Arc<AtomicBool>,
    times: Vec<Arc<Mutex<Vec<Instant>>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Streams {
    fn start(engine: &Engine) -> Streams {
        let stop = Arc::new(AtomicBool::new(false));
        let times: Vec<_> = (0..STREAMS).map(|_| Arc::new(Mutex::new(Vec::new()))).collect();
        let tasks = times
            .iter()
            .enumerate()
            .map(|(s, times)| {
                let (engine, stop, times) = (engine.clone(), stop.clone(), times.clone());
                tokio::spawn(async move {
                    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| (i * 7 + s as u32 * 13) % 256).collect();
                    while !stop.load(Ordering::Relaxed) {
                        let mut rx = engine.submit(prompt.clone(), MAX_TOKENS, SamplingParams::default()).unwrap();
                        let mut last = None;
                        while let Some(e) = rx.recv().await {
                            match e {
                                Event::Token(..) => {
                                    let now = Instant::now();
                                    // The first token of a new request is not an inter-token gap.
                                    if last.is_some() {
                                        times.lock().await.push(now);
                                    }
                                    last = Some(now);
                                }
                                Event::Done { .. } => break,
                                other => panic!("stream {s}: {other:?}"),
                            }
                            if stop.load(Ordering::Relaxed) {
                                break;
                            }
                        }
                    }
                })
            })
            .collect();
        Streams { stop, times, tasks }
    }

    /// Tokens and inter-token gaps of every stream inside `from..to`.
    async fn between(&self, from: Instant, to: Instant) -> (usize, Vec<Duration>) {
        let (mut tokens, mut gaps) = (0, Vec::new());
        for t in &self.times {
            let t = t.lock().await;
            let inside: Vec<Instant> = t.iter().copied().filter(|x| *x >= from && *x < to).collect();
            tokens += inside.len();
            gaps.extend(inside.windows(2).map(|w| w[1] - w[0]).filter(|g| *g < Duration::from_secs(60)));
        }
        (tokens, gaps)
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
    }
}

fn percentile(mut v: Vec<Duration>, p: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

#[tokio::main]
async fn main() {
    println!("| benchmark | alone | with interference | ratio | notes |");
    println!("| --- | --- | --- | --- | --- |");
    let secs = std::env::var("KVGATE_BENCH_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(4u64);
    let span = Duration::from_secs(secs);

    // Decode beside arriving handoffs, into the same pool: back to back (far more than any
    // prefill sends), and paced at 8 a second (65k prompt tokens/s, about ten times what this
    // machine prefills of this model).
    let e = engine(2.0);
    let rig = Rig::new(e.pool.clone(), HANDOFF_TOKENS, WINDOW, true).await;
    let mut idle_handoffs = Vec::new();
    for _ in 0..5 {
        idle_handoffs.push(rig.send_one().await);
    }
    let streams = Streams::start(&e);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut busy_handoffs = Vec::new();
    for (name, every) in [("back to back", Duration::ZERO), ("8 a second", Duration::from_millis(125))] {
        let t0 = Instant::now();
        tokio::time::sleep(span).await;
        let t1 = Instant::now();
        let mut sent = 0;
        let mut next = Instant::now();
        while t1.elapsed() < span {
            tokio::time::sleep_until(next.into()).await;
            next += every;
            busy_handoffs.push(rig.send_one().await);
            sent += 1;
        }
        let t2 = Instant::now();
        let (alone, _) = streams.between(t0, t1).await;
        let (beside, _) = streams.between(t1, t2).await;
        let (alone, beside) = (alone as f64 / (t1 - t0).as_secs_f64(), beside as f64 / (t2 - t1).as_secs_f64());
        let per_s = sent as f64 / (t2 - t1).as_secs_f64();
        println!(
            "| decode tokens/s, {STREAMS} sequences, while {HANDOFF_TOKENS}-token handoffs arrive {name} | {alone:.0} | {beside:.0} | {:.2}x | {sent} handoffs ({per_s:.1}/s, {:.0} prompt tokens/s) into the same pool, every check on; aim >= 0.9x |",
            beside / alone,
            per_s * HANDOFF_TOKENS as f64
        );
    }
    streams.stop().await;
    let (idle_h, busy_h) = (percentile(idle_handoffs, 0.5), percentile(busy_handoffs, 0.5));
    println!(
        "| {HANDOFF_TOKENS}-token handoff, median, engine idle / {STREAMS} sequences decoding | {} | {} | {:.2}x | tiny layout ({} pages of 8 KiB); a handoff never waits for a model step |",
        ms(idle_h),
        ms(busy_h),
        busy_h.as_secs_f64() / idle_h.as_secs_f64(),
        HANDOFF_TOKENS / 16
    );
    drop(rig);
    drop(e);

    // Inter-token latency while a long prompt prefills, pacing on and off.
    let long: Vec<u32> = (0..LONG_PROMPT as u32).map(|i| (i * 31) % 256).collect();
    for (stall, name) in [(2.0, "pacing on (--decode-stall-limit 2)"), (f64::INFINITY, "pacing off (2048-token chunks)")] {
        let e = engine(stall);
        let streams = Streams::start(&e);
        tokio::time::sleep(Duration::from_secs(1)).await;
        let t0 = Instant::now();
        tokio::time::sleep(span).await;
        let t1 = Instant::now();
        let mut rx = e.submit(long.clone(), 1, SamplingParams::default()).unwrap();
        while let Some(ev) = rx.recv().await {
            if matches!(ev, Event::Done { .. }) {
                break;
            }
        }
        let t2 = Instant::now();
        let (_, idle) = streams.between(t0, t1).await;
        let (_, busy) = streams.between(t1, t2).await;
        streams.stop().await;
        for p in [0.5, 0.99] {
            let (a, b) = (percentile(idle.clone(), p), percentile(busy.clone(), p));
            println!(
                "| inter-token latency p{:.0}, {STREAMS} sequences, while a {LONG_PROMPT}-token prompt prefills, {name} | {} | {} | {:.2}x | aim for p99: <= 2x |",
                p * 100.0,
                ms(a),
                ms(b),
                b.as_secs_f64() / a.as_secs_f64()
            );
        }
        println!(
            "| time to the {LONG_PROMPT}-token prompt's first token beside {STREAMS} decoding sequences, {name} | | {:.2} s | | what pacing costs the long prompt |",
            (t2 - t1).as_secs_f64()
        );
    }
}
