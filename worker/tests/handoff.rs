//! The disaggregated handoff through the real router over loopback: every injected fault is
//! caught by decode with its own reason, nothing is generated from unverified pages, and the
//! pages come back.

mod support;

use serde_json::{Value, json};
use support::Worker;

/// A prompt of 98 bytes + BOS = 99 tokens: 7 pages of 16.
fn prompt() -> String {
    "The tenant's prompt, long enough to span several KV pages of sixteen tokens each, one by one......".to_string()
}

async fn assert_pools_empty(w: &Worker) {
    for role in ["prefill", "decode"] {
        let used = w.metric(&format!(r#"kvgate_kv_pool_pages_in_use{{role="{role}"}}"#)).await;
        assert_eq!(used, 0.0, "{role} still holds pages");
    }
}

async fn mismatches(w: &Worker, reason: &str) -> f64 {
    w.metric(&format!(r#"kvgate_handoff_mismatch_total{{reason="{reason}",role="decode"}}"#)).await
}

async fn decode_tokens(w: &Worker) -> f64 {
    w.metric(r#"kvgate_generation_tokens_total{role="decode"}"#).await
}

/// Three requests through a `local` worker that injects `fault` into every second handoff: the
/// honest ones before and after must equal a colocated worker's output token for token; the
/// faulty one must be a non-200 whose body names the check that failed, counted once under
/// `reason`, with no token made from it.
async fn caught(fault: &str, reason: &str, expect_in_message: &str) {
    let colocated = Worker::colocated(&[]);
    let want = colocated.complete(&prompt(), 8).await;
    let w = Worker::local_with_fault(&[], fault, 2);
    let (status, first) = w.post("/v1/completions", &json!({"prompt": prompt(), "max_tokens": 8, "temperature": 0})).await;
    assert_eq!(status, 200, "{fault}: {first}");
    assert_eq!(first["choices"][0]["text"], want.as_str(), "{fault}: before the failure");
    let honest_tokens = first["usage"]["completion_tokens"].as_f64().unwrap();
    let (status, body) = w.post("/v1/completions", &json!({"prompt": prompt(), "max_tokens": 8, "temperature": 0})).await;
    assert_eq!(status, 502, "{fault}: {body}");
    assert_eq!(body["error"]["code"], format!("kv_handoff_{reason}"), "{fault}: {body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains(expect_in_message), "{fault}: {message}");
    assert!(body.get("choices").is_none());
    assert_eq!(mismatches(&w, reason).await, 1.0, "{fault}");
    assert_eq!(decode_tokens(&w).await, honest_tokens, "{fault}: decode generated from an unverified handoff");
    assert_eq!(w.metric(r#"kvgate_handoff_total{outcome="failed",role="decode"}"#).await, 1.0);
    assert_eq!(w.complete(&prompt(), 8).await, want, "{fault}: after the failure");
    assert_eq!(w.metric(r#"kvgate_handoff_total{outcome="committed",role="decode"}"#).await, 2.0);
    assert_pools_empty(&w).await;
}

#[tokio::test]
async fn kv_sealed_for_another_tenant_is_refused_by_tenant() {
    caught("wrong-tenant", "tenant", "kv_handoff_tenant: page index 0 was sealed for another tenant than the reservation's").await;
}

#[tokio::test]
async fn the_incident_truncated_transfer_is_refused_by_token_count() {
    caught("truncate-transfer", "token_count", "kv_handoff_incomplete: received 16 of 99 reserved tokens").await;
}

#[tokio::test]
async fn a_corrupted_page_fails_its_checksum() {
    caught("corrupt-page", "checksum", "page index 3 does not match its tag").await;
}

#[tokio::test]
async fn a_page_sent_outside_the_reservation_is_a_page_set_violation() {
    caught("drop-page", "page_set", "is not part of the reservation").await;
}

#[tokio::test]
async fn a_duplicated_page_is_a_page_set_violation() {
    caught("duplicate-page", "page_set", "sent twice").await;
}

#[tokio::test]
async fn a_frame_with_a_wrong_mac_is_refused() {
    caught("wrong-auth", "auth", "does not carry its MAC").await;
}

#[tokio::test]
async fn a_foreign_model_fingerprint_is_refused() {
    caught("wrong-fingerprint", "fingerprint", "kv_handoff_fingerprint").await;
}

/// Two requests through a `local` worker whose every second handoff meets `fault`, a failure
/// before any byte reached the client: decode counts the failed transfer as `timeout` and
/// generates nothing from it, and the router tries the request again (`retry_reason`) on a fresh
/// reservation, which is handed off whole. Both answers equal a colocated worker's.
async fn answered_whole_by_a_retry(fault: &str, flags: &[&str], retry_reason: &str) {
    let colocated = Worker::colocated(&[]);
    let want = colocated.complete(&prompt(), 8).await;
    let w = Worker::local_with_fault(flags, fault, 2);
    let (status, first) = w.post("/v1/completions", &json!({"prompt": prompt(), "max_tokens": 8, "temperature": 0})).await;
    assert_eq!((status, &first["choices"][0]["text"]), (200, &Value::from(want.as_str())), "{fault}: before the failure: {first}");
    let honest_tokens = first["usage"]["completion_tokens"].as_f64().unwrap();
    let (status, body) = w.post("/v1/completions", &json!({"prompt": prompt(), "max_tokens": 8, "temperature": 0})).await;
    assert_eq!(status, 200, "{fault}: {body}");
    assert_eq!(body["choices"][0]["text"], want.as_str(), "{fault}: the retry's answer is the exact one");
    assert_eq!(mismatches(&w, "timeout").await, 1.0, "{fault}: the failed transfer is counted");
    for reason in ["prefill_failed", "handoff_timeout"] {
        let retries = w.metric(&format!(r#"kvgate_router_retries_total{{reason="{reason}",role="router"}}"#)).await;
        assert_eq!(retries, if reason == retry_reason { 1.0 } else { 0.0 }, "{fault}: retries for {reason}");
    }
    assert_eq!(w.metric(r#"kvgate_handoff_total{outcome="failed",role="decode"}"#).await, 1.0);
    assert_eq!(w.metric(r#"kvgate_handoff_total{outcome="committed",role="decode"}"#).await, 2.0);
    assert_eq!(decode_tokens(&w).await, 2.0 * honest_tokens, "{fault}: decode generated only from the two whole handoffs");
    assert_pools_empty(&w).await;
}

// A prefill that dies mid-transfer: decode sees half the pages and no commit.
#[tokio::test]
async fn a_prefill_that_dies_mid_transfer_is_a_timeout_and_the_request_is_tried_again() {
    answered_whole_by_a_retry("die-mid-transfer", &[], "prefill_failed").await;
}

// A sender that stalls past the reservation's deadline (starved of CPU, or a path that hung):
// decode refuses its late frame as `timeout`; prefill relays that verdict, and as it says the
// transfer was late, not wrong, the router tries the request again.
#[tokio::test]
async fn a_transfer_that_outlives_its_reservation_is_refused_as_late_and_tried_again() {
    answered_whole_by_a_retry("stall-mid-transfer", &["--handoff-timeout-ms", "1000"], "handoff_timeout").await;
}

#[tokio::test]
async fn disaggregated_output_equals_colocated_output_and_survives_failures() {
    let colocated = Worker::colocated(&[]);
    // Every second handoff is truncated; the ones in between must still be exact.
    let w = Worker::local_with_fault(&[], "truncate-transfer", 2);
    let prompts = ["Hello", "The quick brown fox jumps over the lazy dog", "a", &"long prompt ".repeat(40), "kvgate"];
    let mut failures = 0;
    for p in prompts {
        let want = colocated.complete(p, 24).await;
        assert_eq!(w.complete(p, 24).await, want, "{p:?}");
        let (status, body) = w.post("/v1/completions", &json!({"prompt": p, "max_tokens": 24, "temperature": 0})).await;
        if p.len() + 1 > 16 {
            assert_eq!(status, 502, "{body}");
            failures += 1;
        } else {
            // A one-page prompt cannot be truncated: the fault changes nothing.
            assert_eq!(body["choices"][0]["text"], want);
        }
    }
    assert_eq!(mismatches(&w, "token_count").await, failures as f64);
    assert_pools_empty(&w).await;
}

#[tokio::test]
async fn streaming_through_the_router_equals_the_whole_answer() {
    let w = Worker::local(&[]);
    let whole = w.complete("stream through the handoff", 16).await;
    let (status, datas) =
        w.stream("/v1/completions", &json!({"prompt": "stream through the handoff", "max_tokens": 16, "temperature": 0, "stream": true})).await;
    assert_eq!(status, 200);
    assert_eq!(datas.last().unwrap(), "[DONE]");
    let text: String =
        datas[..datas.len() - 1].iter().map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"].as_str().unwrap().to_string()).collect();
    assert_eq!(text, whole);
    assert_eq!(w.metric(r#"kvgate_handoff_total{outcome="committed",role="decode"}"#).await, 2.0);
    assert_pools_empty(&w).await;
}

#[tokio::test]
async fn a_truncated_request_never_sees_the_previous_tenants_kv() {
    // The pools hold exactly one request (4 pages), so the second request gets exactly the
    // first one's pages.
    let secret = "SECRET-7f3a9c-ACCOUNT-4242-PASSWORD-hunter2-";
    let other = "Another customer's prompt of the same size..";
    assert_eq!(secret.len(), other.len());
    let w = Worker::local_with_fault(&["--kv-pool-tokens", "64", "--context-window", "64"], "truncate-transfer", 2);
    let (status, first) = w.post("/v1/completions", &json!({"prompt": secret, "max_tokens": 16, "temperature": 0})).await;
    assert_eq!(status, 200, "{first}");
    for stream in [false, true] {
        let body = json!({"prompt": other, "max_tokens": 16, "temperature": 0, "stream": stream});
        let resp = w.http.post(format!("{}/v1/completions", w.base)).json(&body).send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        assert_eq!(status, 502, "stream={stream}: {text}");
        assert!(!text.contains("SECRET") && !text.contains("hunter2") && !text.contains("4242"), "leaked: {text}");
        assert!(!text.contains("choices"), "a token was produced: {text}");
        // Keep the fault on the next (odd, honest) request in step: send one in between.
        let (status, _) = w.post("/v1/completions", &json!({"prompt": secret, "max_tokens": 16, "temperature": 0})).await;
        assert_eq!(status, 200);
    }
    assert_eq!(decode_tokens(&w).await, 3.0 * 16.0, "only the three honest requests generated");
    assert_pools_empty(&w).await;
}

/// A fault no check can see: after two clean handoffs, prefill sends each page with its halves
/// swapped (the KV of a layout it does not report). Every checksum, MAC and fingerprint holds,
/// decode counts no mismatch and answers 200, and the output is wrong: what the operator's
/// canary, which compares outputs, exists to catch. Also set through the environment, as the
/// test images do.
#[tokio::test]
async fn wrong_layout_kv_after_n_handoffs_passes_every_check_but_changes_the_output() {
    let colocated = Worker::colocated(&[]);
    let want = colocated.complete(&prompt(), 16).await;
    let mut cmd = std::process::Command::new(Worker::bin());
    cmd.arg("local").args(["--listen", "127.0.0.1:0"]);
    cmd.env("KVGATE_INJECT_FAULT", "wrong-layout").env("KVGATE_ALLOW_FAULT_INJECTION", "true").env("KVGATE_FAULT_AFTER", "2");
    let w = Worker::from_command(cmd);
    for n in 1..=2 {
        assert_eq!(w.complete(&prompt(), 16).await, want, "handoff {n} is before the fault");
    }
    let (status, body) = w.post("/v1/completions", &json!({"prompt": prompt(), "max_tokens": 16, "temperature": 0})).await;
    assert_eq!(status, 200, "{body}");
    assert_ne!(body["choices"][0]["text"], want.as_str(), "wrong KV gave the right output: the fault did nothing");
    let (_, metrics) = w.get("/metrics").await;
    assert_eq!(kvgate_testenv::metrics::family_sum(&metrics, "kvgate_handoff_mismatch_total"), 0.0, "a check saw it: {metrics}");
    assert_eq!(w.metric(r#"kvgate_handoff_total{outcome="committed",role="decode"}"#).await, 3.0);
}
