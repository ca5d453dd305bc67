//! What exporting traces costs: the same split deployment (router, prefill and decode processes
//! of the release worker, JSON logs) with OTLP export to a real Jaeger and without, side by side
//! in one run, rounds alternating so drift hits both. Printed as a Markdown table (docs/benchmarks.md,
//! "Benchmarks"). Run with `cargo bench -p kvgate-worker --bench tracing` after `make tools`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvgate_testenv::jaeger::Jaeger;
use kvgate_testenv::process::free_port;

const WORKER: &str = env!("CARGO_BIN_EXE_kvgate-worker");
const ROUNDS: usize = 5;
const SEQUENTIAL: usize = 20;
const CLIENTS: usize = 8;
const PER_CLIENT: usize = 5;

/// One deployment: three processes, killed on drop.
struct Split {
    children: Vec<Child>,
    router: String,
}

impl Drop for Split {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn split(secret: &std::path::Path, otlp: Option<&str>) -> Split {
    let (prefill, decode, kv, router) = (free_port(), free_port(), free_port(), free_port());
    let secret = format!("--handoff-secret-file={}", secret.display());
    let roles: [Vec<String>; 3] = [
        vec!["decode".into(), format!("--listen=127.0.0.1:{decode}"), format!("--kv-listen=127.0.0.1:{kv}")],
        vec!["prefill".into(), format!("--listen=127.0.0.1:{prefill}")],
        vec!["router".into(), format!("--listen=127.0.0.1:{router}"), format!("--prefill=127.0.0.1:{prefill}"), format!("--decode=127.0.0.1:{decode}")],
    ];
    let children = roles
        .into_iter()
        .map(|mut args| {
            args.extend([secret.clone(), "--log-format=json".into()]);
            let mut cmd = Command::new(WORKER);
            cmd.args(&args).stdout(Stdio::null()).stderr(Stdio::null()).env_remove("OTEL_EXPORTER_OTLP_ENDPOINT");
            if let Some(endpoint) = otlp {
                cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint);
            }
            cmd.spawn().expect("spawn kvgate-worker")
        })
        .collect();
    let s = Split { children, router: format!("http://127.0.0.1:{router}") };
    let deadline = Instant::now() + Duration::from_secs(60);
    while kvgate_testenv::http::get(&format!("{}/readyz", s.router)).is_none() {
        assert!(Instant::now() < deadline, "the workers did not become ready");
        std::thread::sleep(Duration::from_millis(100));
    }
    s
}

async fn complete(client: &reqwest::Client, router: &str, prompt: &str) -> Duration {
    let t = Instant::now();
    let body = serde_json::json!({ "prompt": prompt, "max_tokens": 16, "temperature": 0 });
    let r = client.post(format!("{router}/v1/completions")).json(&body).send().await.expect("a response");
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    r.bytes().await.unwrap();
    t.elapsed()
}

/// (median latency of sequential requests, requests/s of CLIENTS concurrent clients).
async fn round(router: &str, prompt: &str) -> (Duration, f64) {
    let client = reqwest::Client::new();
    let mut lat = Vec::new();
    for _ in 0..SEQUENTIAL {
        lat.push(complete(&client, router, prompt).await);
    }
    lat.sort();
    let t = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (client, router, prompt) = (client.clone(), router.to_string(), prompt.to_string());
            tokio::spawn(async move {
                for _ in 0..PER_CLIENT {
                    complete(&client, &router, &prompt).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    (lat[lat.len() / 2], (CLIENTS * PER_CLIENT) as f64 / t.elapsed().as_secs_f64())
}

fn median<T: PartialOrd + Copy>(mut v: Vec<T>) -> T {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let dir = std::env::temp_dir().join(format!("kvgate-bench-tracing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "bench-tracing-deployment-secret-0123456789").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let jaeger = Jaeger::start(&dir.join("jaeger")).unwrap_or_else(|e| panic!("{e:#}"));
    let off = split(&secret, None);
    let on = split(&secret, Some(&jaeger.otlp_endpoint));
    let prompt = "a prompt of a few dozen tokens, long enough for several pages of the tiny model's pool, and then some more words";
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    // Warm both (first connections, allocator, Jaeger's first batch).
    rt.block_on(round(&off.router, prompt));
    rt.block_on(round(&on.router, prompt));
    let (mut off_rows, mut on_rows) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        off_rows.push(rt.block_on(round(&off.router, prompt)));
        on_rows.push(rt.block_on(round(&on.router, prompt)));
    }
    let lat = |rows: &[(Duration, f64)]| median(rows.iter().map(|r| r.0.as_secs_f64() * 1000.0).collect());
    let rps = |rows: &[(Duration, f64)]| median(rows.iter().map(|r| r.1).collect());
    let (lat_off, lat_on, rps_off, rps_on) = (lat(&off_rows), lat(&on_rows), rps(&off_rows), rps(&on_rows));
    println!("| benchmark | traces off | traces on (OTLP to Jaeger) | on / off | notes |");
    println!("| --- | --- | --- | --- | --- |");
    println!(
        "| one request at a time, median latency | {lat_off:.1} ms | {lat_on:.1} ms | {:.2}x | tiny model, 16 tokens, split roles, JSON logs; median of {ROUNDS} rounds of {SEQUENTIAL} |",
        lat_on / lat_off
    );
    println!(
        "| {CLIENTS} concurrent clients, requests/s | {rps_off:.1} | {rps_on:.1} | {:.2}x | {PER_CLIENT} requests each; median of {ROUNDS} rounds |",
        rps_on / rps_off
    );
    let _ = std::fs::remove_dir_all(&dir);
}
