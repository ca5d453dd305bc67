//! Router, prefill and decode as three separate processes: the rejection path, a prefill that
//! really dies, expired and replayed frames of a peer. Attacks by someone without the secret
//! are in `trust_boundaries.rs`.

mod support;

use std::time::Duration;

use serde_json::json;
use support::kv::KvClient;
use support::{TestSecret, cluster, decode, eventually, faulty_cluster};

#[tokio::test]
async fn a_prompt_prefill_can_never_hold_is_rejected_and_decode_frees_its_reservation() {
    let c = cluster(&["--kv-pool-tokens", "128"], &[]);
    let (status, body) = c.router.post("/v1/completions", &json!({"prompt": "x".repeat(299), "max_tokens": 4})).await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["error"]["code"], "prompt_too_large");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("300") && message.contains("128"), "{message}");
    assert_eq!(c.decode.metric(r#"kvgate_handoff_reservations_cancelled_total{role="decode"}"#).await, 1.0);
    assert_eq!(c.decode.metric(r#"kvgate_handoff_total{outcome="rejected",role="decode"}"#).await, 1.0);
    assert_eq!(c.decode.metric(r#"kvgate_handoff_total{outcome="committed",role="decode"}"#).await, 0.0);
    assert_eq!(c.decode.metric(r#"kvgate_kv_pool_pages_in_use{role="decode"}"#).await, 0.0);
    assert_eq!(c.prefill.metric(r#"kvgate_kv_pool_pages_in_use{role="prefill"}"#).await, 0.0, "nothing was computed");
    assert_eq!(c.router.metric(r#"kvgate_requests_rejected_total{reason="prompt_too_large",role="router"}"#).await, 1.0);
    // What fits still works.
    assert!(!c.router.complete("fits", 4).await.is_empty());
}

#[tokio::test]
async fn a_rejected_prompt_forwarded_anyway_is_caught_as_rejected_forwarded() {
    let c = faulty_cluster(&["--kv-pool-tokens", "128"], "ignore-rejection");
    let (status, body) = c.router.post("/v1/completions", &json!({"prompt": "y".repeat(299), "max_tokens": 4})).await;
    assert_eq!(status, 413, "{body}");
    eventually(&c.decode, r#"kvgate_handoff_mismatch_total{reason="rejected_forwarded",role="decode"}"#, 1.0).await;
    assert_eq!(c.decode.metric(r#"kvgate_generation_tokens_total{role="decode"}"#).await, 0.0);
    eventually(&c.decode, r#"kvgate_kv_pool_pages_in_use{role="decode"}"#, 0.0).await;
    eventually(&c.prefill, r#"kvgate_kv_pool_pages_in_use{role="prefill"}"#, 0.0).await;
}

#[tokio::test]
async fn through_a_prefill_that_forwards_what_it_rejects_honest_prompts_are_served_exactly_and_only_rejected_ones_are_caught() {
    // The incident's fault does only what it names: prompts that fit are untouched.
    let c = faulty_cluster(&["--kv-pool-tokens", "128"], "ignore-rejection");
    let reference = support::Worker::colocated(&[]);
    let honest = ["hi", "a prompt that spans a few pages of the tiny model's KV cache", &"z".repeat(100)];
    for prompt in honest {
        assert_eq!(c.router.complete(prompt, 8).await, reference.complete(prompt, 8).await, "{prompt:?} through the faulty prefill");
    }
    let oversized = ["y".repeat(200), "y".repeat(299)];
    for prompt in &oversized {
        let (status, body) = c.router.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 4})).await;
        assert_eq!((status, body["error"]["code"].as_str()), (413, Some("prompt_too_large")), "{body}");
    }
    eventually(&c.decode, r#"kvgate_handoff_mismatch_total{reason="rejected_forwarded",role="decode"}"#, 2.0).await;
    let committed = c.decode.metric(r#"kvgate_handoff_total{outcome="committed",role="decode"}"#).await;
    assert_eq!(committed, honest.len() as f64, "every honest prompt's handoff committed");
    for reason in ["token_count", "checksum", "page_set", "auth", "fingerprint", "timeout", "first_token"] {
        let series = format!(r#"kvgate_handoff_mismatch_total{{reason="{reason}",role="decode"}}"#);
        assert_eq!(c.decode.metric(&series).await, 0.0, "{reason}: only rejected prompts may be caught");
    }
    assert_eq!(c.router.metric(r#"kvgate_requests_rejected_total{reason="prompt_too_large",role="router"}"#).await, 2.0);
    eventually(&c.decode, r#"kvgate_kv_pool_pages_in_use{role="decode"}"#, 0.0).await;
    eventually(&c.prefill, r#"kvgate_kv_pool_pages_in_use{role="prefill"}"#, 0.0).await;
}

#[tokio::test]
async fn a_prefill_process_that_dies_mid_transfer_leaves_no_pages_behind() {
    let mut c = faulty_cluster(&[], "die-mid-transfer");
    let prompt = "a prompt that spans six pages of the tiny model's KV cache, sixteen tokens per page.....";
    assert_eq!(prompt.len() + 1, 89, "6 pages of 16");
    let (status, body) = c.router.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 4})).await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(body["error"]["code"], "kv_handoff_timeout");
    assert!(body["error"]["message"].as_str().unwrap().contains("after 3 of 6 pages"), "{body}");
    let exit = c.prefill.child.wait().unwrap();
    assert_eq!(exit.code(), Some(137), "the prefill process really exited");
    assert_eq!(c.decode.metric(r#"kvgate_handoff_mismatch_total{reason="timeout",role="decode"}"#).await, 1.0);
    assert_eq!(c.decode.metric(r#"kvgate_generation_tokens_total{role="decode"}"#).await, 0.0);
    assert_eq!(c.decode.metric(r#"kvgate_kv_pool_pages_in_use{role="decode"}"#).await, 0.0);
    // With its only prefill peer gone, the router says so instead of hanging.
    let (status, body) = c.router.post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 4})).await;
    assert!(status == 503 || status == 502, "{status} {body}");
}

#[tokio::test]
async fn expired_and_replayed_frames_of_a_peer_are_refused_and_unused_reservations_only_expire() {
    let secret = TestSecret::new();
    let d = decode(&["--handoff-timeout-ms", "400", &secret.arg()]);
    let signer = secret.signer();
    let mismatch = |reason: &str| format!(r#"kvgate_handoff_mismatch_total{{reason="{reason}",role="decode"}}"#);

    // A reservation whose time ran out before its peer sent anything: refused as timed out,
    // counted as expired, and no integrity mismatch (nothing was moved).
    let c = KvClient::reserve(&d, &signer, 20, 4).await.holding(&secret.secret);
    tokio::time::sleep(Duration::from_millis(700)).await;
    let (ok, reason, _) = c.send(&c.pages()).await;
    assert!(!ok);
    assert_eq!(reason, "timeout");
    assert!(d.metric(r#"kvgate_handoff_reservations_expired_total{role="decode"}"#).await >= 1.0);

    // A complete, well-formed transfer commits; replaying its commit is refused.
    let c = KvClient::reserve(&d, &signer, 20, 4).await.holding(&secret.secret);
    let mut frames = c.pages();
    frames.push(c.commit(65));
    let (ok, reason, message) = c.send(&frames).await;
    assert!(ok, "{reason}: {message}");
    let (ok, reason, message) = c.send(&[c.commit(65)]).await;
    assert!(!ok);
    assert_eq!(reason, "unknown_handoff");
    assert!(message.contains("already committed"), "{message}");
    assert_eq!(d.metric(&mismatch("unknown_handoff")).await, 1.0);
    assert_eq!(d.metric(r#"kvgate_handoff_total{outcome="committed",role="decode"}"#).await, 1.0);

    // Nobody decodes the committed handoff: its pages are freed at the deadline all the same.
    eventually(&d, r#"kvgate_kv_pool_pages_in_use{role="decode"}"#, 0.0).await;
    assert_eq!(d.metric(r#"kvgate_generation_tokens_total{role="decode"}"#).await, 0.0);
}

#[tokio::test]
async fn fault_injection_needs_its_safety_flag() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate-worker"))
        .args(["prefill", "--listen", "127.0.0.1:0"])
        .env("KVGATE_INJECT_FAULT", "truncate-transfer")
        .env_remove("KVGATE_ALLOW_FAULT_INJECTION")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs KVGATE_ALLOW_FAULT_INJECTION=true"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A decode process SIGKILLed mid-generation. A non-streaming answer is held at the router until
/// decode is done, so its client has seen nothing: the router asks another pair
/// (`decode_stream_broke`) and the client gets the whole answer a colocated worker gives, 200.
/// A streamed answer whose client already has tokens is not tried again: its stream ends with an
/// error, never with tokens from a second generation spliced in.
#[tokio::test]
async fn a_decode_killed_mid_generation_is_retried_on_another_pair_unless_the_client_saw_tokens() {
    const TOKENS: u32 = 1500;
    let body = json!({"prompt": "Hello", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": true});
    let (status, want) = support::Worker::colocated(&[]).post("/v1/completions", &body).await;
    assert_eq!((status, want["usage"]["completion_tokens"].as_u64()), (200, Some(u64::from(TOKENS))), "{want}");

    for stream in [false, true] {
        let secret = TestSecret::new();
        let mut decodes = [decode(&[&secret.arg()]), decode(&[&secret.arg()])];
        let prefill = support::Worker::spawn(&["prefill", "--listen", "127.0.0.1:0", &secret.arg()]);
        let at = |w: &support::Worker| w.base.trim_start_matches("http://").to_string();
        let (p, d0, d1) = (at(&prefill), at(&decodes[0]), at(&decodes[1]));
        let router = support::Worker::spawn(&["router", "--listen", "127.0.0.1:0", "--prefill", &p, "--decode", &d0, &d1, &secret.arg()]);
        let ask = {
            let (http, url) = (router.http.clone(), format!("{}/v1/completions", router.base));
            let body = json!({"prompt": "Hello", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": true, "stream": stream});
            tokio::spawn(async move {
                let resp = http.post(url).json(&body).send().await.unwrap();
                (resp.status().as_u16(), resp.text().await.unwrap())
            })
        };
        // The decode that generates is the one whose token counter moves: it dies mid-answer.
        let series = r#"kvgate_generation_tokens_total{role="decode"}"#;
        let mut killed = None;
        for _ in 0..500 {
            for (i, d) in decodes.iter().enumerate() {
                if d.metric(series).await > 0.0 {
                    killed = Some(i);
                }
            }
            if killed.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let killed = killed.expect("a decode started generating");
        decodes[killed].child.kill().unwrap();
        let generated_before = decodes[1 - killed].metric(series).await;
        assert_eq!(generated_before, 0.0, "stream {stream}: one decode generated");
        let (status, text) = ask.await.unwrap();
        let retries = router.metric(r#"kvgate_router_retries_total{reason="decode_stream_broke",role="router"}"#).await;
        if stream {
            // Tokens reached the client before decode died: the stream ends with an error.
            assert_eq!(status, 200, "a stream's status is sent with its first token: {text}");
            let chunks: Vec<serde_json::Value> =
                text.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect();
            let last = chunks.last().unwrap();
            assert_eq!(last["error"]["code"], "peer_error", "stream: its last chunk is the error: {last}");
            let texts = chunks.iter().filter(|c| c["choices"][0]["text"].is_string()).count();
            assert!(texts > 0 && texts < TOKENS as usize, "stream: {texts} token chunks reached the client before the error");
            assert!(chunks.iter().all(|c| c["choices"][0]["finish_reason"].is_null()), "stream: no chunk says it finished");
            assert_eq!(retries, 0.0, "a stream whose client saw tokens is not tried again");
        } else {
            let got: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            assert_eq!(status, 200, "held: {got}");
            assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"], "the retried answer is the whole one");
            assert_eq!(got["usage"]["completion_tokens"].as_u64(), Some(u64::from(TOKENS)));
            assert_eq!(retries, 1.0, "one retry, for decode_stream_broke");
            assert_eq!(decodes[1 - killed].metric(series).await, f64::from(TOKENS), "the other decode generated the answer");
        }
    }
}
