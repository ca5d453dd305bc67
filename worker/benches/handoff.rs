//! Handoff benchmarks, printed as a Markdown table (see docs/benchmarks.md). Run with
//! `cargo bench -p kvgate-worker --bench handoff`. Rows that are compared run side by side: for
//! each layout and prompt, memcpy of the same bytes, the best single loopback TCP stream (large
//! writes and reads, big socket buffers), the KV handoff with integrity checks on and off, and
//! the same stream from and into buffers as long as the transfer (what moving the bytes through
//! memory costs a plain stream).

use std::time::{Duration, Instant};

use kvgate_worker::kv::host_region::HostBuffer;
use kvgate_worker::kv::{KvDtype, KvLayout, KvPool};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[path = "common/rig.rs"]
mod rig;
use rig::Rig;

/// Runs per measurement (the median is reported); fewer for the largest transfers.
fn runs(bytes: usize) -> usize {
    if bytes > 512 << 20 { 5 } else { 7 }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// The tiny model's layout: 8 KiB pages of f32 KV.
const TINY: KvLayout = KvLayout { num_layers: 2, num_kv_heads: 2, head_dim: 16, page_size: 16, dtype: KvDtype::F32 };
/// A Llama-3-8B-shaped layout: 32 layers, 8 KV heads of 128, bf16, 16-token pages of 2 MiB.
const LLAMA_8B: KvLayout = KvLayout { num_layers: 32, num_kv_heads: 8, head_dim: 128, page_size: 16, dtype: KvDtype::BF16 };

/// memcpy of `bytes` from one buffer to another, page by page: the floor of any copy.
fn memcpy(bytes: usize, page: usize) -> Duration {
    let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let mut dst = vec![0u8; bytes];
    median(
        (0..runs(bytes))
            .map(|_| {
                let t = Instant::now();
                for (d, s) in dst.chunks_mut(page).zip(src.chunks(page)) {
                    d.copy_from_slice(s);
                }
                std::hint::black_box(&dst);
                t.elapsed()
            })
            .collect(),
    )
}

/// Writes and reads of the TCP streams.
const TCP_CHUNK: usize = 4 << 20;

/// One loopback TCP stream moving `bytes` with 4 MiB writes and reads and 8 MiB socket
/// buffers, then a one-byte ack: the best a single stream does on this machine.
async fn best_tcp(bytes: usize) -> Duration {
    tcp_stream(bytes, vec![7u8; TCP_CHUNK], vec![0u8; TCP_CHUNK]).await.0
}

/// The same stream writing from successive 4 MiB pieces of `src` and reading into successive
/// pieces of `dst`, each taken again from its start when it is shorter than `bytes`: with 4 MiB
/// buffers the data stays in cache (the best stream), with buffers as long as the transfer it
/// comes from memory and goes to memory, as a handoff's pages do. Gives the buffers back.
async fn tcp_stream<B>(bytes: usize, src: B, mut dst: B) -> (Duration, B, B)
where
    B: std::ops::DerefMut<Target = [u8]> + Send + 'static,
{
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(8 << 20).unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(1).unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut done = 0;
        while done < bytes {
            let at = done % dst.len();
            let end = (at + TCP_CHUNK.min(bytes - done)).min(dst.len());
            let n = s.read(&mut dst[at..end]).await.unwrap();
            assert!(n > 0, "stream ended early");
            done += n;
        }
        s.write_all(&[1]).await.unwrap();
        dst
    });
    let client = tokio::net::TcpSocket::new_v4().unwrap();
    client.set_send_buffer_size(8 << 20).unwrap();
    let t = Instant::now();
    let mut s: TcpStream = client.connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    let mut done = 0;
    while done < bytes {
        let at = done % src.len();
        let n = TCP_CHUNK.min(bytes - done).min(src.len() - at);
        s.write_all(&src[at..at + n]).await.unwrap();
        done += n;
    }
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).await.unwrap();
    let took = t.elapsed();
    let dst = server.await.unwrap();
    (took, src, dst)
}

/// A prefill and a decode moving `tokens` of layout `l`, with every check on or off.
async fn rig(l: KvLayout, tokens: usize, checks: bool) -> Rig {
    // Room for the one token a reservation must leave to generate.
    let decode_pool = KvPool::host(l, l.pages_for(tokens) + 1).unwrap();
    Rig::new(decode_pool, tokens, tokens + 1, checks).await
}

/// What one round of `side_by_side` measured (medians).
struct Round {
    tcp: Duration,
    on: Duration,
    off: Duration,
    /// The stream between two buffers as long as the transfer (`tcp_stream`).
    tcp_memory: Duration,
}

/// The best TCP stream, the handoff with checks on and off and the stream from and into memory,
/// in rounds that take one of each in turn (this machine's speed drifts between seconds; a
/// ratio of neighbours drifts less): the median of each.
async fn side_by_side(l: KvLayout, tokens: usize) -> Round {
    let bytes = l.pages_for(tokens) * l.page_bytes();
    let (on, off) = (rig(l, tokens, true).await, rig(l, tokens, false).await);
    // Memory of the pools' kind (huge pages where the kernel grants them).
    let region = || HostBuffer::commit(bytes).expect("memory for the stream's buffers");
    let (mut src, mut dst) = (region(), region());
    let (mut tcp, mut with, mut without, mut memory) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs(bytes) {
        tcp.push(best_tcp(bytes).await);
        with.push(on.send_one().await);
        without.push(off.send_one().await);
        let took;
        (took, src, dst) = tcp_stream(bytes, src, dst).await;
        memory.push(took);
    }
    Round { tcp: median(tcp), on: median(with), off: median(without), tcp_memory: median(memory) }
}

/// CPU time of one integrity primitive over every page of the transfer, one side's worth:
/// where the cost of "checks on" goes.
fn per_page(bytes: usize, page: usize, f: impl Fn(&[u8]) -> u64) -> Duration {
    let data: Vec<u8> = (0..bytes).map(|i| (i * 31 % 251) as u8).collect();
    median(
        (0..runs(bytes))
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
        .args(["local", "--listen", "127.0.0.1:0", "--context-window", "32800"])
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
    for _ in 0..3 {
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
    println!("| benchmark | result | notes |");
    println!("| --- | --- | --- |");
    let cases = [("tiny", TINY, 32 * 1024), ("Llama-3-8B-shaped", LLAMA_8B, 1024), ("Llama-3-8B-shaped", LLAMA_8B, 8 * 1024)];
    // `KVGATE_BENCH_QUICK=1`: only the 8B-shaped 8k rows, no TTFT (for profiling one change).
    let quick = std::env::var_os("KVGATE_BENCH_QUICK").is_some();
    for (name, l, tokens) in cases {
        if quick && tokens != 8 * 1024 {
            continue;
        }
        let (page, pages) = (l.page_bytes(), l.pages_for(tokens));
        let bytes = page * pages;
        let mib = bytes as f64 / (1 << 20) as f64;
        let rate = |d: Duration| format!("{:.0} MiB/s, {:.0} pages/s ({:.1} ms)", mib / d.as_secs_f64(), pages as f64 / d.as_secs_f64(), d.as_secs_f64() * 1e3);
        let copy = memcpy(bytes, page);
        let Round { tcp, on, off, tcp_memory } = side_by_side(l, tokens).await;
        let what = format!("{name} layout, {tokens}-token prompt ({mib:.0} MiB, {pages} pages of {} KiB)", page >> 10);
        println!("| memcpy, {what} | {} | the floor of any copy |", rate(copy));
        println!("| best loopback TCP stream, {what} | {} | 4 MiB writes and reads, 8 MiB socket buffers |", rate(tcp));
        println!(
            "| KV handoff, checks on, {what} | {} | frames, a POLYVAL tag per page, keyed-BLAKE3 MAC over header and tag, digest, page writes, ack |",
            rate(on)
        );
        println!("| KV handoff, checks off, {what} | {} | same transfer, no tag/MAC/digest work |", rate(off));
        println!(
            "| loopback TCP stream from memory into memory, {what} | {} ({:.2}x the best stream; the handoff with every check on runs at {:.2}x this rate) | the best stream's writes and reads, but from and into two buffers as long as the transfer, in memory of the pools' kind (one mapping advised for huge pages) |",
            rate(tcp_memory),
            tcp.as_secs_f64() / tcp_memory.as_secs_f64(),
            tcp_memory.as_secs_f64() / on.as_secs_f64()
        );
        println!(
            "| handoff / best TCP, checks on / off, {what} | {:.2}x, {:.2}x slower | aims: at least 0.7x; at most 1.3x |",
            tcp.as_secs_f64() / on.as_secs_f64(),
            on.as_secs_f64() / off.as_secs_f64()
        );
    }
    if quick {
        return;
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let key =
        kvgate_proto::auth::DeploymentKey::new(&[7; 32]).unwrap().frame_key(kvgate_proto::handoff::HandoffId(1), kvgate_proto::handoff::TenantTag::of("bench"));
    for (name, l, tokens) in [("tiny, 32k", TINY, 32 * 1024), ("8B-shaped, 8k", LLAMA_8B, 8 * 1024)] {
        let (page, bytes) = (l.page_bytes(), l.page_bytes() * l.pages_for(tokens));
        let mib = bytes as f64 / (1 << 20) as f64;
        let tags = key.page_tags();
        let tag = per_page(bytes, page, |p| tags.tag(1, p) as u64);
        println!(
            "| of which: the page tag over every page, one side ({name}) | {:.1} ms ({:.0} MiB/s) | paid by prefill and by decode; POLYVAL: {} |",
            ms(tag),
            mib / tag.as_secs_f64(),
            kvgate_proto::polyval::implementation()
        );
        // What protocol v4 paid instead (a MAC and a checksum over every byte), and the other
        // candidates, measured beside it.
        let mac = per_page(bytes, page, |p| u64::from(key.mac(&[p]).0[0]));
        let sum = per_page(bytes, page, xxhash_rust::xxh3::xxh3_64);
        let poly = per_page(bytes, page, |p| {
            use poly1305::universal_hash::{KeyInit, UniversalHash};
            let mut m = poly1305::Poly1305::new(&[9u8; 32].into());
            m.update_padded(p);
            u64::from(m.finalize()[0])
        });
        let polyval = per_page(bytes, page, |p| {
            use polyval::universal_hash::{KeyInit, UniversalHash};
            let mut m = polyval::Polyval::new(&[9u8; 16].into());
            m.update_padded(p);
            u64::from(m.finalize()[0])
        });
        for (what, d) in [
            ("keyed BLAKE3 (v4's MAC)", mac),
            ("xxh3 (v4's checksum)", sum),
            ("Poly1305 (candidate)", poly),
            ("POLYVAL, RustCrypto crate (candidate)", polyval),
        ] {
            println!(
                "| beside it: {what} over every page, one side ({name}) | {:.1} ms ({:.0} MiB/s), {:.2}x the page tag's time | |",
                ms(d),
                mib / d.as_secs_f64(),
                d.as_secs_f64() / tag.as_secs_f64()
            );
        }
    }
    // How the cost grows: handoff time against pages (8B-shaped pages, checks on, with the best
    // TCP stream for the same bytes) and time to first token against prompt length. Written to
    // target/bench/*.csv too, for bench/plot.py's figures in docs/.
    let mut curve = Vec::new();
    for tokens in [1024usize, 2048, 4096, 8192] {
        let Round { tcp, on, .. } = side_by_side(LLAMA_8B, tokens).await;
        let pages = LLAMA_8B.pages_for(tokens);
        println!(
            "| handoff time, {pages} pages of 2 MiB (8B-shaped, {tokens} tokens) | {:.1} ms (best TCP {:.1} ms, {:.2}x) | {:.0} pages/s with every check |",
            ms(on),
            ms(tcp),
            tcp.as_secs_f64() / on.as_secs_f64(),
            pages as f64 / on.as_secs_f64()
        );
        curve.push(format!("{pages},{:.3},{:.3}", ms(on), ms(tcp)));
    }
    write_csv("handoff_pages.csv", "pages,handoff_ms,best_tcp_ms", &curve);
    let mut curve = Vec::new();
    for tokens in [1024usize, 2048, 4096, 8192, 16384, 32768] {
        let colocated = ttft(&["--colocated"], tokens).await;
        let disaggregated = ttft(&[], tokens).await;
        println!(
            "| time to first token, {tokens}-token prompt | colocated {:.1} ms, disaggregated {:.1} ms ({:.2}x) | tiny model, median of 3 |",
            ms(colocated),
            ms(disaggregated),
            disaggregated.as_secs_f64() / colocated.as_secs_f64()
        );
        curve.push(format!("{tokens},{:.3},{:.3}", ms(colocated), ms(disaggregated)));
    }
    write_csv("ttft.csv", "prompt_tokens,colocated_ms,disaggregated_ms", &curve);
}

/// Writes a curve for bench/plot.py under target/bench/.
fn write_csv(name: &str, header: &str, rows: &[String]) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(name), format!("{header}\n{}\n", rows.join("\n"))).unwrap();
}
