//! The OpenAI-compatible API of a real `kvgate-worker local` process, over loopback.

mod support;

use serde_json::{Value, json};
use support::Worker;

#[tokio::test]
async fn completion_answers_with_text_usage_and_finish_reason() {
    let w = Worker::colocated(&[]);
    let (status, body) = w.post("/v1/completions", &json!({"prompt": "Hello", "max_tokens": 5, "temperature": 0})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["model"], "tiny");
    assert!(body["id"].as_str().unwrap().starts_with("cmpl-"));
    let choice = &body["choices"][0];
    assert!(matches!(choice["finish_reason"].as_str(), Some("length" | "stop")));
    // Byte tokenizer: BOS + 5 bytes.
    assert_eq!(body["usage"]["prompt_tokens"], 6);
    let completion = body["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=5).contains(&completion));
    assert_eq!(body["usage"]["total_tokens"].as_u64().unwrap(), 6 + completion);
    assert!(!choice["text"].as_str().unwrap().is_empty() || choice["finish_reason"] == "stop");
}

/// vLLM's `return_token_ids`: the ids each choice generated, which decode to its text; left out
/// unless asked for. (What `kubectl kvgate check` compares, as it does vLLM's.)
#[tokio::test]
async fn return_token_ids_gives_the_generated_ids() {
    let w = Worker::local(&[]);
    let ask = |return_ids: bool| json!({"prompt": [1, 72, 101, 108], "max_tokens": 6, "temperature": 0, "ignore_eos": true, "return_token_ids": return_ids});
    let (status, body) = w.post("/v1/completions", &ask(true)).await;
    assert_eq!(status, 200, "{body}");
    let ids: Vec<u32> = body["choices"][0]["token_ids"].as_array().expect("token_ids").iter().map(|t| t.as_u64().unwrap() as u32).collect();
    assert_eq!(ids.len(), 6, "{body}");
    let (_, detok) = w.post("/detokenize", &json!({"tokens": ids})).await;
    assert_eq!(detok["prompt"], body["choices"][0]["text"], "{detok}");
    let (_, plain) = w.post("/v1/completions", &ask(false)).await;
    assert!(plain["choices"][0].get("token_ids").is_none(), "{plain}");
    assert_eq!(plain["choices"][0]["text"], body["choices"][0]["text"]);
    // Streams carry no ids: asking for them with `stream` is refused, naming the field.
    let mut streamed = ask(true);
    streamed["stream"] = json!(true);
    let (status, err) = w.post("/v1/completions", &streamed).await;
    assert_eq!((status, err["error"]["param"].as_str()), (400, Some("return_token_ids")), "{err}");
}

#[tokio::test]
async fn greedy_output_is_deterministic_and_prompt_dependent() {
    let w = Worker::colocated(&[]);
    let a = w.complete("The quick brown fox", 24).await;
    assert_eq!(a, w.complete("The quick brown fox", 24).await);
    assert_ne!(a, w.complete("jumps over the lazy dog", 24).await);
}

#[tokio::test]
async fn streaming_chunks_add_up_to_the_whole_answer() {
    let w = Worker::colocated(&[]);
    let whole = w.complete("stream me", 20).await;
    let (status, datas) = w.stream("/v1/completions", &json!({"prompt": "stream me", "max_tokens": 20, "temperature": 0, "stream": true})).await;
    assert_eq!(status, 200);
    assert_eq!(datas.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = datas[..datas.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    let text: String = chunks.iter().map(|c| c["choices"][0]["text"].as_str().unwrap()).collect();
    assert_eq!(text, whole);
    let last = chunks.last().unwrap();
    assert!(last["choices"][0]["finish_reason"].is_string());
    assert_eq!(last["usage"]["prompt_tokens"], 10);
    assert!(chunks[..chunks.len() - 1].iter().all(|c| c["choices"][0]["finish_reason"].is_null()));
}

#[tokio::test]
async fn chat_completions_whole_and_streamed() {
    let w = Worker::colocated(&[]);
    let req = json!({"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 12, "temperature": 0});
    let (status, body) = w.post("/v1/chat/completions", &req).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    let whole = body["choices"][0]["message"]["content"].as_str().unwrap().to_string();

    let mut streamed = req.clone();
    streamed["stream"] = json!(true);
    let (status, datas) = w.stream("/v1/chat/completions", &streamed).await;
    assert_eq!(status, 200);
    assert_eq!(datas.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = datas[..datas.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap_or("")).collect();
    assert_eq!(text, whole);
}

#[tokio::test]
async fn bad_requests_name_the_field() {
    let w = Worker::colocated(&[]);
    let cases: Vec<(&str, Value, &str)> = vec![
        ("/v1/completions", json!({"prompt": "x", "max_tokens": "ten"}), "max_tokens"),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
        ("/v1/completions", json!({"prompt": "x", "temperature": 9}), "temperature"),
        ("/v1/completions", json!({"prompt": "x", "top_p": 0}), "top_p"),
        ("/v1/completions", json!({"prompt": "x", "n": 17}), "n"),
        ("/v1/completions", json!({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}), "stop"),
        ("/v1/completions", json!({"prompt": "x", "logprobs": 21}), "logprobs"),
        ("/v1/completions", json!({"prompt": [1, 999]}), "prompt[1]"),
        ("/v1/completions", json!({"prompt": "x", "presence_penalty": 0.5}), "presence_penalty"),
        ("/v1/completions", json!({"prompt": "x", "suffix": "y"}), "suffix"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), "top_logprobs"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}), "tools"),
        ("/v1/completions", json!({"max_tokens": 3}), "prompt"),
        ("/v1/completions", json!({"prompt": ["a", "b"]}), "prompt"),
        ("/v1/chat/completions", json!({"messages": []}), "messages"),
        ("/v1/chat/completions", json!({"messages": [{"role": "robot", "content": "x"}]}), "messages[0].role"),
    ];
    for (path, body, field) in cases {
        let (status, err) = w.post(path, &body).await;
        assert_eq!(status, 400, "{body} -> {err}");
        assert_eq!(err["error"]["type"], "invalid_request_error", "{err}");
        let param = err["error"]["param"].as_str().unwrap_or("");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(param == field || message.contains(field), "{body}: expected `{field}` named in {err}");
    }
    let (status, err) = w.post_raw("/v1/completions", "{\"prompt\": ").await;
    assert_eq!(status, 400);
    assert!(err["error"]["message"].as_str().unwrap().contains("not valid JSON"), "{err}");

    let (status, err) = w.post("/v1/completions", &json!({"model": "gpt-9", "prompt": "x"})).await;
    assert_eq!(status, 404);
    assert_eq!(err["error"]["code"], "model_not_found");
    assert!(err["error"]["message"].as_str().unwrap().contains("gpt-9"));
    assert_eq!(w.metric(r#"kvgate_requests_total{code="400",role="local"}"#).await, 17.0);
}

#[tokio::test]
async fn a_request_longer_than_the_window_gets_400_with_both_numbers() {
    let w = Worker::colocated(&["--context-window", "64"]);
    let (status, err) = w.post("/v1/completions", &json!({"prompt": "a".repeat(60), "max_tokens": 10})).await;
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["code"], "context_length_exceeded");
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.contains("64 tokens") && message.contains("71 tokens"), "{message}");
    assert_eq!(w.metric(r#"kvgate_requests_rejected_total{reason="context_length_exceeded",role="local"}"#).await, 1.0);
}

#[tokio::test]
async fn a_prompt_that_can_never_fit_the_pool_gets_413_before_any_page_is_taken() {
    // The incident's shape: a window larger than the measured pool.
    let w = Worker::colocated(&["--context-window", "4096", "--kv-pool-tokens", "256"]);
    let (status, err) = w.post("/v1/completions", &json!({"prompt": "z".repeat(400), "max_tokens": 16, "temperature": 0})).await;
    assert_eq!(status, 413, "{err}");
    assert_eq!(err["error"]["code"], "prompt_too_large");
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.contains("417") && message.contains("256"), "{message}");
    assert_eq!(w.metric(r#"kvgate_requests_rejected_total{reason="prompt_too_large",role="local"}"#).await, 1.0);
    assert_eq!(w.metric(r#"kvgate_prompt_tokens_total{role="local"}"#).await, 0.0, "nothing was admitted");
    assert_eq!(w.metric(r#"kvgate_kv_pool_pages_in_use{role="local"}"#).await, 0.0);
    // The worker still serves what fits.
    let (status, _) = w.post("/v1/completions", &json!({"prompt": "fits", "max_tokens": 4})).await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn a_full_pool_makes_requests_wait_then_503() {
    // 1024 tokens of pool; the first request holds 1000 of them while it generates.
    let w = Worker::colocated(&["--context-window", "1024", "--kv-pool-tokens", "1024", "--admission-timeout-ms", "100"]);
    let hog = {
        let (http, base) = (w.http.clone(), w.base.clone());
        tokio::spawn(async move {
            let body = json!({"prompt": "hog", "max_tokens": 1000, "temperature": 0});
            http.post(format!("{base}/v1/completions")).json(&body).send().await.unwrap().status().as_u16()
        })
    };
    // Wait until the hog holds its pages.
    while w.metric(r#"kvgate_kv_pool_pages_in_use{role="local"}"#).await == 0.0 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // What an endpoint picker reads: one request running, the pool nearly full.
    let mut running = 0.0;
    for _ in 0..500 {
        running = w.metric(r#"kvgate_num_requests_running{role="local"}"#).await;
        if running == 1.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(running, 1.0);
    let (in_use, pages) = (w.metric(r#"kvgate_kv_pool_pages_in_use{role="local"}"#).await, w.metric(r#"kvgate_kv_pool_pages{role="local"}"#).await);
    assert_eq!(w.metric(r#"kvgate_kv_cache_usage_ratio{role="local"}"#).await, in_use / pages);
    assert!(in_use / pages > 0.9, "{in_use} of {pages} pages");
    let (status, err) = w.post("/v1/completions", &json!({"prompt": "x".repeat(100), "max_tokens": 10})).await;
    assert_eq!(status, 503, "{err}");
    assert_eq!(err["error"]["code"], "pool_busy");
    assert!(err["error"]["message"].as_str().unwrap().contains("ms"));
    assert_eq!(hog.await.unwrap(), 200);
    // Pages came back: the same request now succeeds.
    let (status, _) = w.post("/v1/completions", &json!({"prompt": "x".repeat(100), "max_tokens": 10})).await;
    assert_eq!(status, 200);
    assert_eq!(w.metric(r#"kvgate_kv_pool_pages_in_use{role="local"}"#).await, 0.0);
    assert_eq!(w.metric(r#"kvgate_requests_total{code="503",role="local"}"#).await, 1.0);
    // The engine publishes its load after the step that ended the request, which may come a
    // moment after the client has its answer.
    for idle in ["kvgate_num_requests_running", "kvgate_num_requests_waiting", "kvgate_kv_cache_usage_ratio"] {
        support::eventually(&w, &format!(r#"{idle}{{role="local"}}"#), 0.0).await;
    }
}

#[tokio::test]
async fn concurrent_requests_each_equal_the_same_request_alone() {
    let w = Worker::colocated(&[]);
    let prompts: Vec<(String, u32)> = (0..12).map(|i| (format!("tenant {i} asks: {}", "why? ".repeat(i * 7)), 8 + (i as u32 * 5) % 23)).collect();
    let mut alone = Vec::new();
    for (p, n) in &prompts {
        alone.push(w.complete(p, *n).await);
    }
    let tasks: Vec<_> = prompts
        .iter()
        .map(|(p, n)| {
            let (http, base) = (w.http.clone(), w.base.clone());
            let body = json!({"prompt": p, "max_tokens": n, "temperature": 0});
            tokio::spawn(async move {
                let v: Value = http.post(format!("{base}/v1/completions")).json(&body).send().await.unwrap().json().await.unwrap();
                v["choices"][0]["text"].as_str().unwrap().to_string()
            })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap(), alone[i], "request {i} changed when batched with others");
    }
    assert_eq!(w.metric(r#"kvgate_kv_pool_pages_in_use{role="local"}"#).await, 0.0, "every page came back");
}

#[tokio::test]
async fn capacity_report_models_health_and_metrics() {
    let w = Worker::colocated(&["--context-window", "512", "--kv-pool-tokens", "1000", "--kv-dtype", "bf16", "--page-size", "32"]);
    let (status, text) = w.get("/v1/kv-pool").await;
    assert_eq!(status, 200);
    let r: kvgate_proto::CapacityReport = serde_json::from_str(&text).unwrap();
    assert_eq!(r.page_size, 32);
    assert_eq!(r.num_pages, 32, "1000 tokens round up to 32 pages of 32");
    assert_eq!(r.capacity_tokens, 1024);
    assert_eq!(r.bytes_per_token, 2 * 2 * 2 * 16 * 2, "layers x K/V x kv heads x head dim x bf16");
    assert_eq!((r.device.as_str(), r.dtype.as_str(), r.model.as_str()), ("cpu", "bf16", "tiny"));
    assert_eq!(r.model_fingerprint.len(), 16);
    assert_eq!(r.layout_fingerprint.len(), 16);

    let (_, models) = w.get("/v1/models").await;
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(models["data"][0]["max_model_len"], 512);
    assert_eq!(w.get("/healthz").await.0, 200);
    assert_eq!(w.get("/readyz").await.0, 200);

    // Every known label value is exported from the start, at zero.
    let (_, metrics) = w.get("/metrics").await;
    for series in [
        r#"kvgate_requests_total{code="413",role="local"} 0"#,
        r#"kvgate_requests_rejected_total{reason="pool_busy",role="local"} 0"#,
        r#"kvgate_kv_pool_capacity_tokens{role="local"} 1024"#,
        r#"kvgate_context_window_tokens{role="local"} 512"#,
        r#"kvgate_kv_pool_pages{role="local"} 32"#,
        r#"kvgate_build_info{component="worker",version="#,
    ] {
        assert!(metrics.contains(series), "missing {series}");
    }
    for name in [
        "kvgate_time_to_first_token_seconds",
        "kvgate_inter_token_latency_seconds",
        "kvgate_request_duration_seconds",
        "kvgate_prompt_tokens_total",
        "kvgate_generation_tokens_total",
        "kvgate_kv_pool_used_tokens",
    ] {
        assert!(metrics.contains(name), "missing {name}");
    }
    w.complete("count me", 3).await;
    assert!(w.metric(r#"kvgate_generation_tokens_total{role="local"}"#).await >= 1.0);
    assert_eq!(w.metric(r#"kvgate_prompt_tokens_total{role="local"}"#).await, 9.0);
}

#[tokio::test]
async fn tokenize_and_detokenize_round_trip_with_and_without_special_tokens() {
    let w = Worker::colocated(&[]);
    let (status, with) = w.post("/tokenize", &json!({"prompt": "hi"})).await;
    assert_eq!(status, 200, "{with}");
    assert_eq!(with["tokens"], json!([256, 104, 105]), "the byte tokenizer's BOS, then the bytes");
    let (_, without) = w.post("/tokenize", &json!({"prompt": "hi", "add_special_tokens": false})).await;
    assert_eq!(without["tokens"], json!([104, 105]));
    let (_, text) = w.post("/detokenize", &json!({"tokens": [104, 105]})).await;
    assert_eq!(text["prompt"], "hi");
    let (status, err) = w.post("/detokenize", &json!({"tokens": [1 << 20]})).await;
    assert_eq!((status, err["error"]["param"].as_str()), (400, Some("tokens")), "{err}");
}

/// Told to stop, a role reports not ready at once, still answers new connections for its
/// shutdown delay (while a Service's endpoints drop it), then stops accepting and exits; without
/// a delay it stops accepting at once.
#[tokio::test]
async fn told_to_stop_a_worker_reports_not_ready_and_answers_through_its_shutdown_delay() {
    let mut w = Worker::colocated(&["--shutdown-delay-ms", "3000"]);
    assert_eq!(w.get("/readyz").await.0, 200);
    let addr = w.base.trim_start_matches("http://").to_string();
    // SAFETY: signalling the child this test spawned, still running.
    unsafe { libc::kill(w.child.id() as i32, libc::SIGTERM) };
    let mut ready = 200;
    for _ in 0..50 {
        ready = fresh_connection(&addr, "GET", "/readyz", "").await.map_or(0, |(s, _)| s);
        if ready == 503 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(ready, 503, "not ready once told to stop");
    let body = json!({"prompt": "still here", "max_tokens": 4, "temperature": 0}).to_string();
    let answered = fresh_connection(&addr, "POST", "/v1/completions", &body).await;
    assert_eq!(answered.as_ref().map(|(s, _)| *s), Some(200), "a new connection during the delay is answered: {answered:?}");
    assert!(w.child.wait().unwrap().success(), "a clean exit after the delay");
    assert!(fresh_connection(&addr, "GET", "/healthz", "").await.is_none(), "nothing listens after it");

    let mut quick = Worker::colocated(&[]);
    let addr = quick.base.trim_start_matches("http://").to_string();
    // SAFETY: as above.
    unsafe { libc::kill(quick.child.id() as i32, libc::SIGTERM) };
    assert!(quick.child.wait().unwrap().success());
    assert!(fresh_connection(&addr, "GET", "/healthz", "").await.is_none(), "without a delay it stops accepting at once");
}

/// One request on a connection of its own (a client that has just resolved the endpoint):
/// (status, body), or `None` when nothing accepts it.
async fn fresh_connection(addr: &str, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let req = match method {
        "POST" => http.post(format!("http://{addr}{path}")).header("content-type", "application/json").body(body.to_string()),
        _ => http.get(format!("http://{addr}{path}")),
    };
    let resp = req.send().await.ok()?;
    Some((resp.status().as_u16(), resp.text().await.ok()?))
}
