//! Starts a real `kvgate-worker` process on a free loopback port and talks to it over HTTP.

#![allow(dead_code)] // each test binary uses a different part of this module

pub mod kv;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvgate_worker::handoff::Secret;
use kvgate_worker::roles::internal_auth::Signer;
use serde_json::Value;

/// A deployment secret for one test: the file the roles read it from, and the keys (a test that
/// plays a peer holds it; an attacker in a test does not use it).
pub struct TestSecret {
    pub path: std::path::PathBuf,
    pub secret: Secret,
}

impl TestSecret {
    pub fn new() -> TestSecret {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("kvgate-test-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("secret-{n}"));
        let bytes: [u8; 24] = rand::random();
        let text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        std::fs::write(&path, &text).unwrap();
        // As the operator mounts it: nobody but the worker's user and group may read it.
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        TestSecret { secret: Secret::new(text.as_bytes()).unwrap(), path }
    }

    /// `--handoff-secret-file=PATH`
    pub fn arg(&self) -> String {
        format!("--handoff-secret-file={}", self.path.display())
    }

    pub fn signer(&self) -> Signer {
        Signer::new(&self.secret)
    }
}

impl Drop for TestSecret {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

pub struct Worker {
    pub child: Child,
    /// The line in which the worker reported where it listens.
    pub line: String,
    pub base: String,
    pub http: reqwest::Client,
}

impl Worker {
    /// `kvgate-worker local --colocated` (one engine, no handoff) with `args`.
    pub fn colocated(args: &[&str]) -> Worker {
        let mut all = vec!["--colocated"];
        all.extend_from_slice(args);
        Worker::local(&all)
    }

    /// `kvgate-worker local` (router, prefill and decode over loopback sockets) with `args`.
    pub fn local(args: &[&str]) -> Worker {
        let mut full = vec!["local", "--listen", "127.0.0.1:0"];
        full.extend_from_slice(args);
        Worker::spawn(&full)
    }

    /// `local` with a prefill fault switched on through the environment (`fault_env`).
    pub fn local_with_fault(args: &[&str], fault: &str, every: u64) -> Worker {
        let mut full = vec!["local", "--listen", "127.0.0.1:0"];
        full.extend_from_slice(args);
        Worker::spawn_with_env(&full, &fault_env(fault, every))
    }

    /// Any `kvgate-worker` serving command; it reports its address on the last line of its
    /// start-up output (`... listening on http://ADDR ...`).
    pub fn spawn(args: &[&str]) -> Worker {
        Worker::spawn_with_env(args, &[])
    }

    /// The same with variables added to its environment.
    pub fn spawn_with_env(args: &[&str], env: &[(String, String)]) -> Worker {
        let mut cmd = Command::new(Self::bin());
        cmd.args(args).envs(env.iter().map(|(k, v)| (k, v))).stderr(Stdio::inherit());
        Worker::from_command(cmd)
    }

    pub fn bin() -> &'static str {
        env!("CARGO_BIN_EXE_kvgate-worker")
    }

    /// Any command that runs a serving `kvgate-worker` (e.g. under a shell that sets limits
    /// first); its stdout is read for the address, stderr is the caller's choice.
    pub fn from_command(mut cmd: Command) -> Worker {
        let mut child = cmd.stdout(Stdio::piped()).spawn().expect("spawn kvgate-worker");
        let args = format!("{cmd:?}");
        let stdout = child.stdout.take().unwrap();
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        while !line.contains("listening on") {
            line.clear();
            if reader.read_line(&mut line).expect("read the worker's output") == 0 {
                panic!("kvgate-worker {args:?} exited before listening");
            }
        }
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("worker did not report its address: {line:?}"))
            .to_string();
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
        Worker { child, base: format!("http://{addr}"), http, line }
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let resp = self.http.post(format!("{}{path}", self.base)).json(body).send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} answered non-JSON ({e}): {text}"));
        (status, value)
    }

    /// Where it listens.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.base.trim_start_matches("http://").parse().unwrap()
    }

    /// A decode worker's KV port, as it announced it.
    pub fn kv_addr(&self) -> std::net::SocketAddr {
        let at = self.line.find("KV port ").expect("decode announces its KV port") + "KV port ".len();
        self.line[at..].split(|c: char| c == ')' || c.is_whitespace()).next().unwrap().parse().unwrap()
    }

    /// The process this worker runs as (its capacity report names it; signed calls are for it).
    pub async fn instance(&self) -> kvgate_proto::auth::Instance {
        let (status, report) = self.get(kvgate_proto::KV_POOL_PATH).await;
        assert_eq!(status, 200, "{report}");
        let report: Value = serde_json::from_str(&report).unwrap();
        report["instance"].as_str().unwrap_or_else(|| panic!("no instance in {report}")).parse().unwrap()
    }

    /// A POST signed as the deployment's own roles sign them, for this worker.
    pub async fn post_signed(&self, signer: &Signer, path: &str, body: &Value) -> (u16, Value) {
        let resp = signer.post(&self.http, &self.base, self.instance().await, path, body).send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    pub async fn post_raw(&self, path: &str, body: &str) -> (u16, Value) {
        let resp = self.http.post(format!("{}{path}", self.base)).body(body.to_string()).send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap())
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let resp = self.http.get(format!("{}{path}", self.base)).send().await.unwrap();
        (resp.status().as_u16(), resp.text().await.unwrap())
    }

    /// Greedy completion text of `prompt`.
    pub async fn complete(&self, prompt: &str, max_tokens: u32) -> String {
        let (status, body) = self
            .post(
                "/v1/completions",
                &serde_json::json!({
                    "prompt": prompt, "max_tokens": max_tokens, "temperature": 0
                }),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        body["choices"][0]["text"].as_str().unwrap().to_string()
    }

    /// The value of one sample line of `/metrics`, e.g. `kvgate_requests_total{code="200",role="local"}`.
    pub async fn metric(&self, series: &str) -> f64 {
        let (_, text) = self.get("/metrics").await;
        kvgate_testenv::metrics::sample(&text, series).unwrap_or_else(|| panic!("no series {series} in /metrics:\n{text}"))
    }

    /// The sum of every sample of one metric family (all label sets) on `/metrics`.
    pub async fn family_sum(&self, family: &str) -> f64 {
        let (_, text) = self.get("/metrics").await;
        kvgate_testenv::metrics::family_sum(&text, family)
    }

    /// Raw SSE `data:` payloads of a streaming request.
    pub async fn stream(&self, path: &str, body: &Value) -> (u16, Vec<String>) {
        let resp = self.http.post(format!("{}{path}", self.base)).json(body).send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        let datas = text.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect();
        (status, datas)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Router, prefill and decode as three processes of one deployment (one secret).
pub struct Cluster {
    pub router: Worker,
    pub prefill: Worker,
    pub decode: Worker,
    pub secret: TestSecret,
}

/// A decode process (`args` should carry the deployment's `--handoff-secret-file`).
pub fn decode(args: &[&str]) -> Worker {
    let mut all = vec!["decode", "--listen", "127.0.0.1:0", "--kv-listen", "127.0.0.1:0"];
    all.extend_from_slice(args);
    Worker::spawn(&all)
}

/// The environment that makes a `testing` build's prefill commit `fault` on every `every`th
/// handoff (`worker/src/handoff/faults.rs`; no flag switches a fault on).
pub fn fault_env(fault: &str, every: u64) -> Vec<(String, String)> {
    [("KVGATE_INJECT_FAULT", fault.to_string()), ("KVGATE_ALLOW_FAULT_INJECTION", "true".into()), ("KVGATE_FAULT_EVERY", every.to_string())]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

pub fn cluster(prefill_args: &[&str], decode_args: &[&str]) -> Cluster {
    cluster_with(prefill_args, decode_args, &[])
}

/// A cluster whose prefill commits `fault` on every handoff.
pub fn faulty_cluster(prefill_args: &[&str], fault: &str) -> Cluster {
    cluster_of(prefill_args, &fault_env(fault, 1), &[], &[])
}

pub fn cluster_with(prefill_args: &[&str], decode_args: &[&str], router_args: &[&str]) -> Cluster {
    cluster_of(prefill_args, &[], decode_args, router_args)
}

fn cluster_of(prefill_args: &[&str], prefill_env: &[(String, String)], decode_args: &[&str], router_args: &[&str]) -> Cluster {
    let secret = TestSecret::new();
    let arg = secret.arg();
    let with_secret = |args: &[&str]| -> Vec<String> { args.iter().map(|a| a.to_string()).chain([arg.clone()]).collect() };
    let decode_args = with_secret(decode_args);
    let decode = decode(&decode_args.iter().map(String::as_str).collect::<Vec<_>>());
    let mut p = vec!["prefill".to_string(), "--listen".into(), "127.0.0.1:0".into()];
    p.extend(with_secret(prefill_args));
    let prefill = Worker::spawn_with_env(&p.iter().map(String::as_str).collect::<Vec<_>>(), prefill_env);
    let (pa, da) = (prefill.base.trim_start_matches("http://").to_string(), decode.base.trim_start_matches("http://").to_string());
    let mut r = vec!["router".to_string(), "--listen".into(), "127.0.0.1:0".into(), "--prefill".into(), pa, "--decode".into(), da];
    r.extend(with_secret(router_args));
    let router = Worker::spawn(&r.iter().map(String::as_str).collect::<Vec<_>>());
    Cluster { router, prefill, decode, secret }
}

/// A connection from the loopback address `127.0.0.N` (every 127/8 address is loopback on
/// Linux): a client with an address of its own, as a stranger on the pod network has.
pub async fn connect_from(n: u8, to: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(std::net::SocketAddr::from(([127, 0, 0, n], 0)))?;
    socket.connect(to).await
}

/// Waits (up to 5 s) for one series of `w`'s /metrics to reach `want`.
pub async fn eventually(w: &Worker, series: &str, want: f64) {
    for _ in 0..100 {
        if w.metric(series).await == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(w.metric(series).await, want, "{series}");
}
