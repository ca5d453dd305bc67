//! kvgate against llama.cpp on the same GGUF file (`cargo bench -p kvgate-worker --bench gguf`,
//! a Markdown table): a random Llama of 8 layers shaped like TinyLlama's (hidden 2048, FFN 5632,
//! 32 heads, 4 KV heads, 32k vocabulary), written in Q4_K_M's mix, in Q8_0 and in f16. kvgate
//! runs colocated with f16 KV, llama.cpp's server (from the pinned `xllamacpp` wheel) with 32
//! slots sharing its f16 cache, and the Q4_K_M file once more with both caches in 8 bits; both
//! on 2 threads, over HTTP with token-id prompts: prefill of 512, 2,048 and 8,192 tokens (a
//! request for one token), decode of one stream and of 8 and 32 at once (64 tokens each,
//! end-of-sequence ignored), and each process's RSS after the runs. Both servers are up at once
//! and every round of every figure is taken from one and then the other, so the machine's drift
//! over minutes falls on both alike. Medians of 3 rounds (the 8,192-token prefill: one).

#[path = "../tests/support/gguf_files.rs"]
mod gguf_files;
#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use futures::future::join_all;
use gguf_files::{Family, Mix, Shape, llama_server, root, write};
use serde_json::{Value, json};
use support::Worker;

const SHAPE: Shape = Shape { hidden: 2048, ffn: 5632, heads: 32, kv_heads: 4, layers: 8, vocab: 32000 };
const PREFILLS: [usize; 3] = [512, 2048, 8192];
const DECODE: usize = 64;
const STREAMS: [usize; 3] = [1, 8, 32];
const ROUNDS: usize = 3;
/// Both servers hold this many tokens of KV, enough for the longest prompt or for every
/// stream at once.
const POOL: usize = 16384;

/// One server as the bench talks to it: a completion of `prompt` asking for `tokens`.
struct Server {
    base: String,
    llamacpp: bool,
    pid: u32,
    http: reqwest::Client,
}

impl Server {
    async fn complete(&self, prompt: &[u32], tokens: usize) -> Duration {
        let (path, body) = if self.llamacpp {
            ("/completion", json!({ "prompt": prompt, "n_predict": tokens, "temperature": 0.0, "ignore_eos": true, "cache_prompt": false }))
        } else {
            ("/v1/completions", json!({ "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": true }))
        };
        let started = Instant::now();
        let resp = self.http.post(format!("{}{path}", self.base)).json(&body).send().await.unwrap();
        assert!(resp.status().is_success(), "{}: {}", self.base, resp.text().await.unwrap_or_default());
        let _: Value = resp.json().await.unwrap();
        started.elapsed()
    }

    fn rss_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
        let kib: f64 = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()?.parse().ok()).unwrap_or(0.0);
        kib / 1024.0
    }
}

fn prompt(n: usize, seed: usize) -> Vec<u32> {
    (0..n).map(|i| 3 + ((i * 7919 + seed * 104729) % (SHAPE.vocab - 4)) as u32).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The aim for a row, as a ratio of kvgate's figure to llama.cpp's.
#[derive(Clone, Copy)]
enum Aim {
    None,
    AtLeast(f64),
    Ahead,
    AtMost(f64),
}

impl Aim {
    fn verdict(self, ratio: f64) -> String {
        let (met, what) = match self {
            Aim::None => return "none set".into(),
            Aim::AtLeast(r) => (ratio >= r, format!("at least {r:.1}x")),
            Aim::Ahead => (ratio > 1.0, "ahead".into()),
            Aim::AtMost(r) => (ratio <= r, format!("at most {r:.1}x")),
        };
        format!("{what}: {}", if met { "met" } else { "missed" })
    }
}

/// Prefill tokens/s at each of `PREFILLS`, decode tokens/s at each of `STREAMS`, RSS in MiB.
#[derive(Default)]
struct Measured {
    prefill: Vec<f64>,
    decode: Vec<f64>,
    rss_mib: f64,
}

impl Server {
    /// Prefill rate of an `n`-token prompt (a request for one token).
    async fn prefill_rate(&self, n: usize, seed: usize) -> f64 {
        n as f64 / self.complete(&prompt(n, seed), 1).await.as_secs_f64()
    }

    /// Decode rate of `streams` streams at once; for one stream, its prompt's own step is
    /// measured apart and left out.
    async fn decode_rate(&self, streams: usize, round: usize) -> f64 {
        if streams == 1 {
            let short = prompt(16, round + 10);
            let (first, all) = (self.complete(&short, 1).await, self.complete(&short, DECODE + 1).await);
            return DECODE as f64 / (all - first).as_secs_f64();
        }
        let started = Instant::now();
        join_all((0..streams).map(|k| {
            let p = prompt(16, round * streams + k + 100);
            async move { self.complete(&p, DECODE).await }
        }))
        .await;
        (streams * DECODE) as f64 / started.elapsed().as_secs_f64()
    }
}

/// Both servers, each round of each figure taken from one and then the other, so that the
/// machine's drift over minutes falls on both sides alike (the idle one waits on a socket).
async fn measure(servers: [&Server; 2]) -> [Measured; 2] {
    for s in servers {
        s.complete(&prompt(32, 99), 4).await; // warm-up
    }
    let mut out: [Measured; 2] = Default::default();
    for (i, n) in PREFILLS.into_iter().enumerate() {
        let rounds = if n > 4096 { 1 } else { ROUNDS };
        let mut rates = [Vec::new(), Vec::new()];
        for round in 0..rounds {
            for (k, s) in servers.iter().enumerate() {
                rates[k].push(s.prefill_rate(n, round + 20 * i).await);
            }
        }
        for (m, r) in out.iter_mut().zip(rates) {
            m.prefill.push(median(r));
        }
    }
    for streams in STREAMS {
        let mut rates = [Vec::new(), Vec::new()];
        for round in 0..ROUNDS {
            for (k, s) in servers.iter().enumerate() {
                rates[k].push(s.decode_rate(streams, round).await);
            }
        }
        for (m, r) in out.iter_mut().zip(rates) {
            m.decode.push(median(r));
        }
    }
    for (m, s) in out.iter_mut().zip(servers) {
        m.rss_mib = s.rss_mib();
    }
    out
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let dir = root().join("target/tmp/gguf-bench");
    std::fs::create_dir_all(&dir).unwrap();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(600)).build().unwrap();
    let mut rows = Vec::new();
    // Every file with f16 KV (llama.cpp's default); the Q4_K_M file also with 8-bit KV on both
    // sides (kvgate's q8_0, llama.cpp's `-ctk q8_0 -ctv q8_0`).
    let runs = [(Mix::Q4KM, "Q4_K_M", "f16"), (Mix::Q4KM, "Q4_K_M", "q8_0"), (Mix::Q8_0, "Q8_0", "f16"), (Mix::F16, "F16", "f16")];
    for (mix, file_name, kv) in runs {
        let file = dir.join(format!("tinyllama-8-layers-{file_name}.gguf"));
        if !file.is_file() {
            write(&file, SHAPE, Family::Llama, mix);
        }
        let size = std::fs::metadata(&file).unwrap().len() as f64 / (1 << 20) as f64;
        let name = if kv == "f16" { file_name.to_string() } else { format!("{file_name}, {kv} KV") };
        let model = file.to_str().unwrap();
        let (window, pool, kv_dtype) = (format!("--context-window={POOL}"), format!("--kv-pool-tokens={POOL}"), format!("--kv-dtype={kv}"));
        let worker = Worker::colocated(&["--model", model, &window, &pool, &kv_dtype, "--max-requests-per-client=64"]);
        let (ctx, slots) = (POOL.to_string(), STREAMS[STREAMS.len() - 1].to_string());
        let server = llama_server(&file, &["-c", &ctx, "-np", &slots, "--kv-unified", "-t", "2", "-ctk", kv, "-ctv", kv]).await;
        let [kvgate, llamacpp] = measure([
            &Server { base: worker.base.clone(), llamacpp: false, pid: worker.child.id(), http: http.clone() },
            &Server { base: server.base.clone(), llamacpp: true, pid: server.pid(), http: http.clone() },
        ])
        .await;
        drop((worker, server));
        let row = |what: String, unit: &str, digits: usize, a: f64, b: f64, aim: Aim| {
            let ratio = a / b;
            (what, format!("{a:.digits$} / {b:.digits$} {unit} ({ratio:.2}x)"), aim.verdict(ratio))
        };
        for (i, n) in PREFILLS.into_iter().enumerate() {
            let what = if i == 0 { format!("{name} ({size:.0} MiB) prefill, {n}-token prompt") } else { format!("{name} prefill, {n}-token prompt") };
            rows.push(row(what, "tokens/s", 0, kvgate.prefill[i], llamacpp.prefill[i], Aim::None));
        }
        for (i, n) in STREAMS.into_iter().enumerate() {
            let what = format!("{name} decode, {n} stream{}", if n == 1 { "" } else { "s" });
            let aim = if n == 1 { Aim::AtLeast(1.0) } else { Aim::Ahead };
            rows.push(row(what, "tokens/s", 1, kvgate.decode[i], llamacpp.decode[i], aim));
        }
        let what = format!("{name} RSS after the runs ({POOL}-token {kv} KV each)");
        rows.push(row(what, "MiB", 0, kvgate.rss_mib, llamacpp.rss_mib, Aim::AtMost(1.1)));
    }
    println!("\n| same GGUF file: kvgate / llama.cpp | result | aim (issue 51) |\n| --- | --- | --- |");
    for (k, v, aim) in rows {
        println!("| {k} | {v} | {aim} |");
    }
}
