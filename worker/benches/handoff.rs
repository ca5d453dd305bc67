//! Handoff benchmarks, printed as a Markdown table (see the README). Run with
//! `cargo bench -p kvgate-worker --bench handoff`. Rows that are compared run side by side.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_proto::roles::Reservation;
use kvgate_worker::handoff::reservations::{Limits, TableConfig};
use kvgate_worker::handoff::sender::{SendOutcome, Transfer};
use kvgate_worker::handoff::{HandoffMetrics, Reservations, Secret, receiver};
use kvgate_worker::kv::{KvDtype, KvLayout, KvPool};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const TOKENS: usize = 32 * 1024;
const RUNS: usize = 7;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// The tiny model's layout: 32k tokens of f32 KV = 16 MiB.
fn layout() -> KvLayout {
    KvLayout { num_layers: 2, num_kv_heads: 2, head_dim: 16, page_size: 16, dtype: KvDtype::F32 }
}

async fn plain_tcp(bytes: usize, chunk: usize) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut sink = vec![0u8; bytes];
        s.read_exact(&mut sink).await.unwrap();
        s.write_all(&[1]).await.unwrap();
    });
    let data = vec![7u8; bytes];
    let t = Instant::now();
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    for c in data.chunks(chunk) {
        s.write_all(c).await.unwrap();
    }
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).await.unwrap();
    let took = t.elapsed();
    server.await.unwrap();
    took
}

async fn handoff(checks: bool) -> Duration {
    let l = layout();
    let pages = l.pages_for(TOKENS);
    let prefill_pool = KvPool::host(l, pages).unwrap();
    // Room for the one token a reservation must leave to generate.
    let decode_pool = KvPool::host(l, pages + 1).unwrap();
    let registry = prometheus::Registry::new();
    let metrics = HandoffMetrics::new(&registry, "bench");
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let kv_addr = listener.local_addr().unwrap().to_string();
    let secret = Secret::random();
    let config = TableConfig {
        timeout: Duration::from_secs(60),
        limits: Limits { window: TOKENS + 1, vocab: 256, max_open: 4 },
        kv_addr: kv_addr.clone(),
        model_fingerprint: "1".into(),
        layout_fingerprint: "2".into(),
    };
    let table = Reservations::new(decode_pool, secret.clone(), config, metrics.clone());
    let table = Arc::new(if checks { table } else { table.without_integrity_checks() });
    let port = receiver::PortLimits { max_connections: 4, frame_timeout: Duration::from_secs(10) };
    tokio::spawn(receiver::serve(listener, table.clone(), port));
    let lease = prefill_pool.lease(TOKENS).unwrap();
    {
        let mut g = prefill_pool.access();
        let page: Vec<u8> = (0..l.page_bytes()).map(|i| (i * 31 % 251) as u8).collect();
        for i in 0..pages {
            g.write_page(&lease, i, &page).unwrap();
        }
    }
    let mut times = Vec::new();
    for _ in 0..RUNS {
        let issued = table.reserve(TOKENS as u32, 1).unwrap();
        let reservation = Reservation {
            handoff_id: issued.id.to_string(),
            pages: issued.pages.clone(),
            reserved_tokens: issued.reserved_tokens,
            max_tokens: issued.max_tokens,
            expires_ms: issued.expires_ms,
            tag: issued.tag.to_hex(),
            kv_addr: kv_addr.clone(),
            model_fingerprint: "1".into(),
            layout_fingerprint: "2".into(),
        };
        let transfer = Transfer {
            pool: &prefill_pool,
            lease: &lease,
            reservation: &reservation,
            secret: &secret,
            first_token: 0,
            first_logprobs: None,
            model_fingerprint: "1",
            layout_fingerprint: "2",
            fault: None,
            metrics: &metrics,
            integrity: checks,
        };
        let t = Instant::now();
        match transfer.run().await.unwrap() {
            SendOutcome::Acked(a) => assert!(a.ok, "{}", a.message),
            SendOutcome::Died => unreachable!(),
        }
        times.push(t.elapsed());
        drop(table.take_committed(issued.id, None).await.unwrap());
    }
    median(times)
}

/// CPU time of one integrity primitive over every page of the transfer, one side's worth:
/// where the cost of "checks on" goes.
fn per_page(bytes: usize, page: usize, f: impl Fn(&[u8]) -> u64) -> Duration {
    let data: Vec<u8> = (0..bytes).map(|i| (i * 31 % 251) as u8).collect();
    median(
        (0..RUNS)
            .map(|_| {
                let t = Instant::now();
                let mut acc = 0u64;
                for p in data.chunks(page) {
                    acc ^= f(p);
                }
                std::hint::black_box(acc);
                t.elapsed()
            })
            .collect(),
    )
}

/// Time to the first streamed token through a real worker process.
async fn ttft(args: &[&str], prompt_tokens: usize) -> Duration {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate-worker"))
        .args(["local", "--listen", "127.0.0.1:0", "--context-window", "16384"])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut reader = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("listening on") {
        line.clear();
        reader.read_line(&mut line).unwrap();
    }
    let addr = line.split("http://").nth(1).unwrap().split_whitespace().next().unwrap().to_string();
    let http = reqwest::Client::new();
    let prompt = "k".repeat(prompt_tokens - 1);
    let mut times = Vec::new();
    for _ in 0..5 {
        let body = serde_json::json!({"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": true});
        let t = Instant::now();
        let mut resp = http.post(format!("http://{addr}/v1/completions")).json(&body).send().await.unwrap();
        let first = resp.chunk().await.unwrap();
        times.push(t.elapsed());
        assert!(first.is_some());
        while resp.chunk().await.unwrap().is_some() {}
    }
    let _ = child.kill();
    let _ = child.wait();
    median(times)
}

#[tokio::main]
async fn main() {
    let bytes = layout().page_bytes() * layout().pages_for(TOKENS);
    let mib = bytes as f64 / (1 << 20) as f64;
    let tcp = median({
        let mut v = Vec::new();
        for _ in 0..RUNS {
            v.push(plain_tcp(bytes, layout().page_bytes()).await);
        }
        v
    });
    let on = handoff(true).await;
    let off = handoff(false).await;
    let rate = |d: Duration| format!("{:.0} MiB/s ({:.1} ms)", mib / d.as_secs_f64(), d.as_secs_f64() * 1e3);
    println!("| benchmark | result | notes |");
    println!("| --- | --- | --- |");
    println!("| plain TCP copy, {mib:.0} MiB in page-sized writes | {} | loopback, the limit on this machine |", rate(tcp));
    println!("| KV handoff of a 32k-token prompt, checks on | {} | frames, xxh3 per page, keyed-BLAKE3 MAC per frame, digest, page writes, ack |", rate(on));
    println!("| KV handoff, integrity checks off | {} | same transfer, no checksum/MAC/digest work |", rate(off));
    println!("| handoff / plain TCP | {:.2}x | aim: at least 0.7x |", tcp.as_secs_f64() / on.as_secs_f64());
    println!("| checks on / off | {:.2}x slower | aim: at most 1.05x |", on.as_secs_f64() / off.as_secs_f64());
    let page = layout().page_bytes();
    let key = kvgate_proto::auth::DeploymentKey::new(&[7; 32]).unwrap().frame_key(kvgate_proto::handoff::HandoffId(1));
    let mac = per_page(bytes, page, |p| u64::from(key.mac(&[p]).0[0]));
    let sum = per_page(bytes, page, xxhash_rust::xxh3::xxh3_64);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!("| of which: keyed BLAKE3 over every page, one side | {:.1} ms ({:.0} MiB/s) | paid by prefill and by decode |", ms(mac), mib / mac.as_secs_f64());
    println!("| of which: xxh3 over every page, one side | {:.1} ms ({:.0} MiB/s) | paid by prefill and by decode |", ms(sum), mib / sum.as_secs_f64());
    for tokens in [1024usize, 8192] {
        let colocated = ttft(&["--colocated"], tokens).await;
        let disaggregated = ttft(&[], tokens).await;
        println!(
            "| time to first token, {tokens}-token prompt | colocated {:.1} ms, disaggregated {:.1} ms ({:.2}x) | tiny model, median of 5 |",
            colocated.as_secs_f64() * 1e3,
            disaggregated.as_secs_f64() * 1e3,
            disaggregated.as_secs_f64() / colocated.as_secs_f64()
        );
    }
}
