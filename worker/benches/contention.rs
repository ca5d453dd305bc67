//! One engine under two kinds of interference, each measured side by side with the same engine
//! left alone (`cargo bench -p kvgate-worker --bench contention`, a Markdown table):
//!
//! - eight sequences decoding while 8k-token handoffs keep arriving into the same KV pool through
//!   the real KV port (the decode role's situation): decode tokens/s in alternating windows
//!   alone and beside the handoffs, with the cores the process kept busy in each, and how long a
//!   handoff takes beside the running model against the same handoff with the engine idle;
//! - eight sequences decoding while a 16k-token prompt prefills in the same process: inter-token
//!   latency p50/p99 against the same streams decoding alone (their own prompts prefilled before
//!   that window), with chunk pacing on (the default, `--decode-stall-limit 2`) and off (chunks
//!   of the whole `--max-batch-tokens`).

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
/// A held stream's one completion (`Streams::held`): long enough to outlast the idle window and
/// the long prompt's prefill at this model's speed.
const HELD_TOKENS: usize = WINDOW - PROMPT;
const HANDOFF_TOKENS: usize = 8192;
const LONG_PROMPT: usize = 16_384;
/// One window of decode alone or beside handoffs.
const ROUND: Duration = Duration::from_millis(250);

fn engine(stall_limit: f64) -> Engine {
    let model = Arc::new(Model::tiny(&Device::Cpu).unwrap());
    let layout = model.kv_layout(16, KvDtype::F32);
    // The streams (held ones are the longest), a long prompt and four handoffs in flight, with
    // room to spare.
    let tokens = STREAMS * (PROMPT + HELD_TOKENS) + LONG_PROMPT + 4 * (HANDOFF_TOKENS + 1);
    let pool = KvPool::host(layout, layout.pages_for(tokens) + 64).unwrap();
    let config =
        SchedulerConfig { max_batch_tokens: 2048, admission_timeout: Duration::from_secs(60), stall_limit, shared_step: Some(Duration::from_millis(10)) };
    Engine::start(model, pool, WINDOW, Metrics::new(&prometheus::Registry::new(), "bench"), config)
}

/// Eight greedy streams that keep decoding until stopped; every token's arrival time, per stream.
/// Started with `start`, each begins a new request as soon as one ends (so prompts keep being
/// prefilled); with `held`, each runs one long request, so once all are decoding no prompt of
/// theirs is prefilled any more.
struct Streams {
    stop: Arc<AtomicBool>,
    times: Vec<Arc<Mutex<Vec<Instant>>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Streams {
    fn start(engine: &Engine) -> Streams {
        Self::run(engine, false)
    }

    fn held(engine: &Engine) -> Streams {
        Self::run(engine, true)
    }

    fn run(engine: &Engine, held: bool) -> Streams {
        let stop = Arc::new(AtomicBool::new(false));
        let times: Vec<_> = (0..STREAMS).map(|_| Arc::new(Mutex::new(Vec::new()))).collect();
        let tasks = times
            .iter()
            .enumerate()
            .map(|(s, times)| {
                let (engine, stop, times) = (engine.clone(), stop.clone(), times.clone());
                tokio::spawn(async move {
                    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| (i * 7 + s as u32 * 13) % 256).collect();
                    let (max_tokens, sampling) =
                        if held { (HELD_TOKENS, SamplingParams { ignore_eos: true, ..Default::default() }) } else { (MAX_TOKENS, SamplingParams::default()) };
                    // A held stream makes one request; the others one after another.
                    let mut more = true;
                    while more && !stop.load(Ordering::Relaxed) {
                        more = !held;
                        let mut rx = engine.submit(prompt.clone(), max_tokens, sampling, "bench").unwrap();
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

    /// Once every stream has had two tokens: its prompt is prefilled and it is decoding.
    async fn all_decoding(&self) {
        loop {
            let mut decoding = 0;
            for t in &self.times {
                decoding += usize::from(!t.lock().await.is_empty());
            }
            if decoding == self.times.len() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
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

/// CPU time of the whole process so far (every thread: the engine's, the handoffs' and the
/// streams').
fn cpu_time() -> Duration {
    // SAFETY: getrusage only writes the struct it is given.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn main() {
    // The worker's own set-up before any thread starts, then the runtime.
    kvgate_heap::one_arena();
    kvgate_worker::cpu::prepare_model_process();
    tokio::runtime::Runtime::new().unwrap().block_on(measure());
}

async fn measure() {
    println!("| benchmark | alone | with interference | ratio | notes |");
    println!("| --- | --- | --- | --- | --- |");
    let secs = std::env::var("KVGATE_BENCH_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(4u64);
    let span = Duration::from_secs(secs);

    // Decode beside arriving handoffs, into the same pool: back to back (far more than any
    // prefill sends), and paced at 8 a second (65k prompt tokens/s, about ten times what this
    // machine prefills of this model). Windows alone and beside handoffs alternate, so each
    // ratio compares two neighbouring windows (this machine's speed drifts between seconds).
    let e = engine(2.0);
    let rig = Rig::new(e.pool.clone(), HANDOFF_TOKENS, WINDOW, true).await;
    let mut idle_handoffs = Vec::new();
    for _ in 0..5 {
        idle_handoffs.push(rig.send_one().await);
    }
    let streams = Streams::start(&e);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut busy_handoffs = Vec::new();
    let rounds = (span.as_secs_f64() / ROUND.as_secs_f64()).ceil() as usize;
    for (name, every) in [("back to back", Duration::ZERO), ("8 a second", Duration::from_millis(125))] {
        let (mut alone, mut beside, mut ratios, mut sent, mut sending) = (Vec::new(), Vec::new(), Vec::new(), 0, Duration::ZERO);
        let (mut cores_alone, mut cores_beside) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let (t0, c0) = (Instant::now(), cpu_time());
            tokio::time::sleep(ROUND).await;
            let (t1, c1) = (Instant::now(), cpu_time());
            let (end, mut next) = (t1 + ROUND, t1);
            while Instant::now() < end && next < end {
                tokio::time::sleep_until(next.into()).await;
                next += every;
                busy_handoffs.push(rig.send_one().await);
                sent += 1;
            }
            tokio::time::sleep_until(end.into()).await;
            let (t2, c2) = (Instant::now(), cpu_time());
            sending += t2 - t1;
            let a = streams.between(t0, t1).await.0 as f64 / (t1 - t0).as_secs_f64();
            let b = streams.between(t1, t2).await.0 as f64 / (t2 - t1).as_secs_f64();
            alone.push(a);
            beside.push(b);
            ratios.push(b / a);
            cores_alone.push((c1 - c0).as_secs_f64() / (t1 - t0).as_secs_f64());
            cores_beside.push((c2 - c1).as_secs_f64() / (t2 - t1).as_secs_f64());
        }
        let per_s = sent as f64 / sending.as_secs_f64();
        println!(
            "| decode tokens/s, {STREAMS} sequences, while {HANDOFF_TOKENS}-token handoffs arrive {name} | {:.0} | {:.0} | {:.2}x | {sent} handoffs ({per_s:.1}/s, {:.0} prompt tokens/s) into the same pool, every check on; the process kept {:.2} cores busy alone, {:.2} beside them; medians of {rounds} alternating {} ms windows, the ratio of neighbouring ones; aim >= 0.9x |",
            median(alone),
            median(beside),
            median(ratios),
            per_s * HANDOFF_TOKENS as f64,
            median(cores_alone),
            median(cores_beside),
            ROUND.as_millis()
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

    // Inter-token latency while a long prompt prefills, pacing on and off, against the same
    // streams with nothing else to do: held streams, so once all are decoding (their prompts
    // prefilled) the idle window holds decode steps only.
    let long: Vec<u32> = (0..LONG_PROMPT as u32).map(|i| (i * 31) % 256).collect();
    for (stall, name) in [(2.0, "pacing on (--decode-stall-limit 2)"), (f64::INFINITY, "pacing off (2048-token chunks)")] {
        let e = engine(stall);
        let streams = Streams::held(&e);
        streams.all_decoding().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let t0 = Instant::now();
        tokio::time::sleep(span / 2).await;
        let t1 = Instant::now();
        let mut rx = e.submit(long.clone(), 1, SamplingParams::default(), "bench").unwrap();
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
