//! One trace per request across router, prefill and decode, proven against a real Jaeger
//! (`make tools` builds it): the roles run as three processes exporting OTLP to it, with JSON
//! logs, and the test reads back what Jaeger stored and what each process logged.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvgate_testenv::jaeger::{Jaeger, Trace};
use serde_json::{Value, json};
use support::TestSecret;

/// A role process with OTLP export on and JSON logs, its log lines kept for the test.
struct Role {
    child: Child,
    base: String,
    lines: Arc<Mutex<Vec<Value>>>,
}

impl Role {
    fn spawn(jaeger: &Jaeger, args: &[String], env: &[(String, String)]) -> Role {
        let mut child = Command::new(support::Worker::bin())
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .arg("--log-format=json")
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &jaeger.otlp_endpoint)
            .env("OTEL_BSP_SCHEDULE_DELAY", "100")
            .env_remove("OTEL_SERVICE_NAME")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kvgate-worker");
        let lines: Arc<Mutex<Vec<Value>>> = Arc::default();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let stderr = BufReader::new(child.stderr.take().unwrap());
        let kept = lines.clone();
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                let value: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("a log line is not JSON ({e}): {line:?}"));
                if let Some(addr) = value["message"].as_str().and_then(|m| m.split("listening on http://").nth(1)) {
                    let _ = addr_tx.send(addr.split_whitespace().next().unwrap_or("").to_string());
                }
                kept.lock().unwrap().push(value);
            }
        });
        let addr = addr_rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| panic!("kvgate-worker {args:?} did not report where it listens"));
        Role { child, base: format!("http://{addr}"), lines }
    }

    fn addr(&self) -> String {
        self.base.trim_start_matches("http://").to_string()
    }

    /// Its log as `kubectl logs` would print it: one JSON object per line.
    fn log_file(&self, path: &std::path::Path) -> std::path::PathBuf {
        let text: String = self.lines.lock().unwrap().iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(path, text).unwrap();
        path.to_path_buf()
    }

    /// The log lines carrying `trace_id`.
    fn lines_of(&self, trace_id: &str) -> Vec<Value> {
        self.lines.lock().unwrap().iter().filter(|l| l["trace_id"] == trace_id).cloned().collect()
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Router, prefill and decode of one deployment, all exporting to `jaeger`.
struct Deployment {
    router: Role,
    _prefill: Role,
    decode: Role,
    _secret: TestSecret,
}

/// Router, prefill and decode; `prefill_env` may switch a prefill fault on (`support::fault_env`).
fn deployment(jaeger: &Jaeger, prefill_env: &[(String, String)]) -> Deployment {
    let secret = TestSecret::new();
    let s = secret.arg();
    let decode = Role::spawn(jaeger, &["decode".into(), "--listen=127.0.0.1:0".into(), "--kv-listen=127.0.0.1:0".into(), s.clone()], &[]);
    let prefill = Role::spawn(jaeger, &["prefill".to_string(), "--listen=127.0.0.1:0".into(), s.clone()], prefill_env);
    let router = Role::spawn(
        jaeger,
        &["router".into(), "--listen=127.0.0.1:0".into(), format!("--prefill={}", prefill.addr()), format!("--decode={}", decode.addr()), s],
        &[],
    );
    Deployment { router, _prefill: prefill, decode, _secret: secret }
}

/// POSTs a completion; (status, body, the response's `traceparent` and `x-request-id`).
async fn complete(router: &Role, headers: &[(&str, &str)], prompt: &str) -> (u16, Value, String, String) {
    let mut req = reqwest::Client::new().post(format!("{}/v1/completions", router.base)).json(&json!({ "prompt": prompt, "max_tokens": 4, "temperature": 0 }));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let (traceparent, request_id) = (header("traceparent"), header("x-request-id"));
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap(), traceparent, request_id)
}

fn jaeger() -> Jaeger {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("kvgate-jaeger-{}-{n}", std::process::id()));
    Jaeger::start(&dir).unwrap_or_else(|e| panic!("{e:#}"))
}

const SERVICES: [&str; 3] = ["kvgate-router", "kvgate-prefill", "kvgate-decode"];

#[tokio::test(flavor = "multi_thread")]
async fn a_request_through_split_roles_is_one_trace_in_jaeger_and_its_log_lines_carry_the_trace_id() {
    let jaeger = jaeger();
    let d = deployment(&jaeger, &[]);
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = format!("00-{trace_id}-00f067aa0ba902b7-01");
    let (status, body, traceparent, request_id) = complete(&d.router, &[("traceparent", &parent), ("x-request-id", "client-req-17")], "hello traces").await;
    assert_eq!(status, 200, "{body}");
    // The client's trace and id come back.
    assert_eq!(request_id, "client-req-17");
    assert!(traceparent.starts_with(&format!("00-{trace_id}-")) && traceparent != parent, "{traceparent}");

    let want = [
        ("kvgate-router", "POST /v1/completions"),
        ("kvgate-router", "admission"),
        ("kvgate-router", "dispatch"),
        ("kvgate-router", "reserve"),
        ("kvgate-router", "prefill"),
        ("kvgate-router", "generate"),
        ("kvgate-decode", "reserve"),
        ("kvgate-prefill", "prefill"),
        ("kvgate-prefill", "prefill_chunk"),
        ("kvgate-prefill", "handoff_send"),
        ("kvgate-decode", "handoff_receive"),
        ("kvgate-decode", "commit_verify"),
        ("kvgate-decode", "decode"),
    ];
    let trace = jaeger.wait_for(trace_id, Duration::from_secs(30), |t: &Trace| want.iter().all(|(s, n)| t.has(s, n)));
    for (service, name) in want {
        assert!(trace.has(service, name), "no {service}/{name} span in trace {trace_id}: {:?}\n{}", trace.summary(), jaeger.log());
    }
    assert_eq!(trace.services(), SERVICES.into_iter().collect(), "{:?}", trace.summary());
    assert!(trace.spans().iter().all(|s| !s.is_error()), "{:?}", trace.summary());
    // The request span carries the GenAI attributes; the handoff spans what moved.
    let spans = trace.spans();
    let request = spans.iter().find(|s| s.name == "POST /v1/completions").unwrap();
    assert_eq!(request.tag("gen_ai.request.model"), Some(&json!("tiny")));
    assert_eq!(request.tag("gen_ai.usage.output_tokens"), Some(&json!(4)));
    assert!(request.tag("gen_ai.usage.input_tokens").and_then(Value::as_i64).is_some_and(|n| n > 0));
    assert!(request.tag("gen_ai.server.time_to_first_token").and_then(Value::as_f64).is_some_and(|t| t > 0.0));
    let received = spans.iter().find(|s| s.name == "handoff_receive").unwrap();
    let sent = spans.iter().find(|s| s.name == "handoff_send").unwrap();
    assert!(received.tag("pages").and_then(Value::as_i64).is_some_and(|p| p > 0));
    assert_eq!(received.tag("pages"), sent.tag("pages"));
    // Whose request it is, on the request's span and on prefill's and decode's (nobody is
    // authenticated here: the client's address).
    for (service, name) in
        [("kvgate-router", "POST /v1/completions"), ("kvgate-prefill", "prefill"), ("kvgate-decode", "handoff_receive"), ("kvgate-decode", "decode")]
    {
        let span = spans.iter().find(|s| s.service == service && s.name == name).unwrap_or_else(|| panic!("no {service}/{name} span"));
        assert_eq!(span.tag("tenant"), Some(&json!("127.0.0.1")), "{service}/{name}: {:?}", span.raw);
    }

    // The router's lines of the request carry its trace id and request id.
    let router_lines = d.router.lines_of(trace_id);
    assert!(router_lines.iter().any(|l| l["request_id"] == "client-req-17"), "router lines: {router_lines:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_handoff_refused_for_a_corrupt_page_is_an_error_span_naming_the_reason_and_decode_logs_it_under_the_trace() {
    let jaeger = jaeger();
    let d = deployment(&jaeger, &support::fault_env("corrupt-page", 1));
    let (status, body, traceparent, _) = complete(&d.router, &[], "a prompt long enough for several pages of the tiny model's pool").await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(body["error"]["code"], "kv_handoff_checksum", "{body}");
    let trace_id = traceparent.split('-').nth(1).unwrap_or_else(|| panic!("no traceparent on the response: {traceparent:?}")).to_string();

    let refused = |t: &Trace| t.spans().iter().any(|s| s.service == "kvgate-decode" && s.name == "handoff_receive" && s.is_error());
    let trace = jaeger.wait_for(&trace_id, Duration::from_secs(30), refused);
    let spans = trace.spans();
    let receipt = spans.iter().find(|s| s.service == "kvgate-decode" && s.name == "handoff_receive").unwrap_or_else(|| panic!("{:?}", trace.summary()));
    assert!(receipt.is_error(), "{:?}", trace.summary());
    assert_eq!(receipt.tag("otel.status_description"), Some(&json!("checksum")), "{:?}", receipt.raw);
    // Prefill heard decode's verdict; the router's request failed with it.
    assert!(spans.iter().any(|s| s.service == "kvgate-prefill" && s.name == "prefill" && s.is_error()), "{:?}", trace.summary());
    assert!(spans.iter().any(|s| s.service == "kvgate-router" && s.name == "POST /v1/completions" && s.is_error()), "{:?}", trace.summary());

    // Decode's mismatch line carries the trace id (and the handoff id), so `jq` finds it.
    let lines = d.decode.lines_of(&trace_id);
    let mismatch = lines.iter().find(|l| l["message"] == "KV handoff refused").unwrap_or_else(|| panic!("decode lines of {trace_id}: {lines:?}"));
    assert_eq!(mismatch["reason"], "checksum");
    assert!(mismatch["handoff_id"].as_str().is_some_and(|h| h.len() == 32), "{mismatch}");
    assert_eq!(mismatch["tenant"], "127.0.0.1", "whose request the mismatch hit: {mismatch}");
    assert_eq!(mismatch["level"], "WARN");
}

/// A dashboard panel's data link, by dashboard and panel title.
fn data_link(dashboard: &str, title: &str) -> String {
    let path = format!("{}/../dashboards/{dashboard}.json", env!("CARGO_MANIFEST_DIR"));
    let d: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let panel = d["panels"].as_array().unwrap().iter().find(|p| p["title"] == title).unwrap_or_else(|| panic!("{dashboard}: no panel {title:?}"));
    panel["fieldConfig"]["defaults"]["links"][0]["url"].as_str().unwrap_or_else(|| panic!("{title}: no data link")).to_string()
}

/// The trace ids the Jaeger search a link opens finds, with Grafana's variables filled in:
/// the UI's `/search` takes the query API's parameters.
async fn follow(jaeger: &Jaeger, link: &str, vars: &[(&str, String)]) -> Vec<String> {
    let mut url = link.replace("${jaeger}/search?", &format!("{}/api/traces?", jaeger.query_url));
    for (name, value) in vars {
        url = url.replace(&format!("${{{name}}}"), value);
    }
    assert!(!url.contains("${"), "a variable left unfilled: {url}");
    let body = match reqwest::get(&url).await {
        Ok(r) => r.text().await.unwrap_or_else(|e| panic!("{url}: {e}")),
        Err(e) => panic!("{url}: {e}"),
    };
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{url}: {e}: {body}"));
    v["data"].as_array().unwrap_or_else(|| panic!("{url}: {body}")).iter().map(|t| t["traceID"].as_str().unwrap().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_dashboards_links_to_jaeger_find_the_refused_handoff_and_the_slow_request() {
    let jaeger = jaeger();
    let d = deployment(&jaeger, &support::fault_env("corrupt-page", 1));
    let from = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() - 1000;
    let (status, body, traceparent, _) = complete(&d.router, &[], "a prompt long enough for several pages of the tiny model's pool").await;
    assert_eq!(status, 502, "{body}");
    let trace_id = traceparent.split('-').nth(1).unwrap().to_string();
    let refused = |t: &Trace| t.spans().iter().any(|s| s.name == "handoff_receive" && s.is_error()) && t.has("kvgate-router", "POST /v1/completions");
    let trace = jaeger.wait_for(&trace_id, Duration::from_secs(30), refused);
    // The request's duration as the router's span recorded it (what the link filters on), not
    // as this client timed it: on a loaded machine the client's clock also counts waiting for
    // a core, and once made the span shorter than a quarter of it.
    let root = trace.spans().into_iter().find(|s| s.service == "kvgate-router" && s.name == "POST /v1/completions").unwrap();
    let took = root.raw["duration"].as_f64().expect("a span's duration in microseconds") / 1e6;
    let to = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() + 1000;
    let range = [("__from", from.to_string()), ("__to", to.to_string())];

    let mismatches = data_link("integrity", "Handoff mismatches by reason");
    let by = |reason: &str| -> Vec<(&str, String)> { range.iter().cloned().chain([("__field.labels.reason", reason.to_string())]).collect() };
    assert_eq!(follow(&jaeger, &mismatches, &by("checksum")).await, [trace_id.as_str()], "the checksum series' link");
    assert!(follow(&jaeger, &mismatches, &by("token_count")).await.is_empty(), "another reason's link finds nothing");
    let all = data_link("integrity", "Handoff mismatches in range");
    assert_eq!(follow(&jaeger, &all, &range).await, [trace_id.as_str()]);

    // The request duration panel's link: requests at least as slow as the point clicked.
    let slow = data_link("serving", "Request duration");
    let at = |seconds: f64| -> Vec<(&str, String)> { range.iter().cloned().chain([("__value.raw", format!("{seconds:.6}"))]).collect() };
    assert_eq!(follow(&jaeger, &slow, &at(took / 4.0)).await, [trace_id.as_str()], "a request slower than the value clicked");
    assert!(follow(&jaeger, &slow, &at(took * 4.0 + 1.0)).await.is_empty(), "none slower than four times its duration");
}

/// docs/observability.md's "Finding the request behind a mismatch": its three commands, with each
/// `kubectl logs ... |` replaced by the same pod's log as a file, run by `sh` as written.
fn readme_steps() -> Vec<String> {
    kvgate_testenv::readme::blocks("docs/observability.md", "## Finding the request behind a mismatch").iter().map(|b| b.replace("\\\n", " ")).collect()
}

fn run_step(command: &str, env: &[(&str, &str)]) -> String {
    let out = Command::new("sh").arg("-c").arg(command).envs(env.iter().copied()).output().expect("sh, curl and jq are needed (make test-deps installs them)");
    assert!(out.status.success(), "`{command}` failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// `kubectl logs -n "$NS" -l ...component=ROLE ... |` -> `cat FILE |`.
fn from_file(command: &str, role: &str, file: &std::path::Path) -> String {
    let (kubectl, rest) = command.split_once('|').unwrap_or_else(|| panic!("no pipe in {command}"));
    assert!(kubectl.trim_start().starts_with("kubectl logs") && kubectl.contains(&format!("component={role}")), "{kubectl}");
    format!("cat '{}' |{rest}", file.display())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_readme_walk_from_a_mismatch_to_its_request_works_as_written() {
    let jaeger = jaeger();
    let d = deployment(&jaeger, &support::fault_env("corrupt-page", 1));
    let (status, body, traceparent, request_id) =
        complete(&d.router, &[("x-request-id", "walk-1")], "a prompt long enough for several pages of the tiny model's pool").await;
    assert_eq!((status, request_id.as_str()), (502, "walk-1"), "{body}");
    let trace_id = traceparent.split('-').nth(1).unwrap().to_string();
    jaeger.wait_for(&trace_id, Duration::from_secs(30), |t: &Trace| t.spans().iter().any(|s| s.name == "handoff_receive" && s.is_error()));

    let dir = std::env::temp_dir().join(format!("kvgate-walk-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let steps = readme_steps();
    assert_eq!(steps.len(), 3, "{steps:?}");
    let env = [("NS", "default"), ("NAME", "walk"), ("JAEGER", jaeger.query_url.as_str())];

    // 1. Decode's refusal names the reason, the handoff and the trace.
    let out = run_step(&from_file(&steps[0], "decode", &d.decode.log_file(&dir.join("decode.log"))), &env);
    let row: Vec<&str> = out.lines().next().unwrap_or_else(|| panic!("step 1 printed nothing")).split('\t').collect();
    assert_eq!((row[1], row[3]), ("checksum", trace_id.as_str()), "{out}");
    let found = row[3].to_string();
    let env = [env[0], env[1], env[2], ("TRACE_ID", found.as_str())];

    // 2. Jaeger has every role's spans of that request, the refusal among them.
    let out = run_step(&steps[1], &env);
    for want in ["kvgate-router\tPOST /v1/completions", "kvgate-prefill\thandoff_send", "kvgate-decode\thandoff_receive\tchecksum"] {
        assert!(out.lines().any(|l| l.starts_with(want)), "step 2 has no {want:?}:\n{out}");
    }

    // 3. The router's access line gives the client's request id and what it got.
    let out = run_step(&from_file(&steps[2], "router", &d.router.log_file(&dir.join("router.log"))), &env);
    let line: Value = serde_json::from_str(out.lines().next().unwrap_or_else(|| panic!("step 3 printed nothing"))).unwrap();
    assert_eq!((line["request_id"].as_str(), line["status"].as_i64()), (Some("walk-1"), Some(502)), "{out}");
    let _ = std::fs::remove_dir_all(dir);
}
