//! Router, prefill and decode as three separate processes: the rejection path, a prefill that
//! really dies, and attacks on decode's KV port from a client that does not hold the secret.

mod support;

use std::time::Duration;

use kvgate_proto::handoff::{CommitFrame, Frame, HEADER_LEN, HandoffId, PageFrame, parse_header};
use kvgate_proto::roles::Reservation;
use serde_json::json;
use support::Worker;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use xxhash_rust::xxh3::xxh3_64;

struct Cluster {
    router: Worker,
    prefill: Worker,
    decode: Worker,
}

fn decode(args: &[&str]) -> Worker {
    let mut all = vec!["decode", "--listen", "127.0.0.1:0", "--kv-listen", "127.0.0.1:0"];
    all.extend_from_slice(args);
    Worker::spawn(&all)
}

fn cluster(prefill_args: &[&str], decode_args: &[&str]) -> Cluster {
    let decode = decode(decode_args);
    let mut p = vec!["prefill", "--listen", "127.0.0.1:0"];
    p.extend_from_slice(prefill_args);
    let prefill = Worker::spawn(&p);
    let (pa, da) = (prefill.base.trim_start_matches("http://").to_string(), decode.base.trim_start_matches("http://").to_string());
    let router = Worker::spawn(&["router", "--listen", "127.0.0.1:0", "--prefill", &pa, "--decode", &da]);
    Cluster { router, prefill, decode }
}

async fn eventually(w: &Worker, series: &str, want: f64) {
    for _ in 0..100 {
        if w.metric(series).await == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(w.metric(series).await, want, "{series}");
}

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
    let c = cluster(&["--kv-pool-tokens", "128", "--allow-fault-injection", "--inject-fault", "ignore-rejection"], &[]);
    let (status, body) = c.router.post("/v1/completions", &json!({"prompt": "y".repeat(299), "max_tokens": 4})).await;
    assert_eq!(status, 413, "{body}");
    eventually(&c.decode, r#"kvgate_handoff_mismatch_total{reason="rejected_forwarded",role="decode"}"#, 1.0).await;
    assert_eq!(c.decode.metric(r#"kvgate_generation_tokens_total{role="decode"}"#).await, 0.0);
    eventually(&c.decode, r#"kvgate_kv_pool_pages_in_use{role="decode"}"#, 0.0).await;
    eventually(&c.prefill, r#"kvgate_kv_pool_pages_in_use{role="prefill"}"#, 0.0).await;
}

#[tokio::test]
async fn a_prefill_process_that_dies_mid_transfer_leaves_no_pages_behind() {
    let mut c = cluster(&["--allow-fault-injection", "--inject-fault", "die-mid-transfer"], &[]);
    let prompt = "a prompt that spans seven pages of the tiny model's KV cache, sixteen tokens per page...";
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

/// A client of decode's KV port, holding a reservation but not the deployment's secret.
struct KvClient {
    reservation: Reservation,
    page_bytes: usize,
}

impl KvClient {
    async fn reserve(w: &Worker, prompt_tokens: u32) -> KvClient {
        let (status, body) = w.post("/internal/v1/reserve", &json!({"prompt_tokens": prompt_tokens, "max_tokens": 4})).await;
        assert_eq!(status, 200, "{body}");
        let reservation: Reservation = serde_json::from_value(body).unwrap();
        let (_, report) = w.get("/v1/kv-pool").await;
        let report: kvgate_proto::CapacityReport = serde_json::from_str(&report).unwrap();
        KvClient { reservation, page_bytes: (report.bytes_per_token * report.page_size as u64) as usize }
    }

    fn id(&self) -> HandoffId {
        self.reservation.handoff_id.parse().unwrap()
    }

    fn tag(&self) -> [u8; 32] {
        let t = &self.reservation.tag;
        std::array::from_fn(|i| u8::from_str_radix(&t[2 * i..2 * i + 2], 16).unwrap())
    }

    fn page(&self, index: u32, tag: [u8; 32], handoff: HandoffId) -> Frame {
        let payload = vec![0u8; self.page_bytes];
        let tokens = (self.reservation.reserved_tokens - index * 16).min(16);
        Frame::Page(PageFrame { handoff, tag, index, page: self.reservation.pages[index as usize], tokens, checksum: xxh3_64(&payload), payload })
    }

    fn commit(&self) -> Frame {
        let checksum = xxh3_64(&vec![0u8; self.page_bytes]);
        let digest_input: Vec<u8> = (0..self.reservation.pages.len()).flat_map(|_| checksum.to_le_bytes()).collect();
        Frame::Commit(CommitFrame {
            handoff: self.id(),
            tag: self.tag(),
            total_tokens: self.reservation.reserved_tokens,
            page_count: self.reservation.pages.len() as u32,
            digest: xxh3_64(&digest_input),
            first_token: 65,
            model_fingerprint: u64::from_str_radix(&self.reservation.model_fingerprint, 16).unwrap(),
            layout_fingerprint: u64::from_str_radix(&self.reservation.layout_fingerprint, 16).unwrap(),
        })
    }

    /// Sends `frames` on one connection and returns decode's ack: (ok, reason, message).
    async fn send(&self, frames: &[Frame]) -> (bool, String, String) {
        let mut s = tokio::net::TcpStream::connect(&self.reservation.kv_addr).await.unwrap();
        for f in frames {
            if s.write_all(&f.encode()).await.is_err() {
                break; // decode already refused and closed
            }
        }
        let mut header = [0u8; HEADER_LEN];
        s.read_exact(&mut header).await.unwrap();
        let h = parse_header(&header).unwrap();
        let mut body = vec![0u8; h.body_len as usize];
        s.read_exact(&mut body).await.unwrap();
        match Frame::decode_body(h.kind, &body).unwrap() {
            Frame::Ack(a) => (a.ok, a.reason, a.message),
            other => panic!("expected an ack, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn forged_unknown_expired_and_replayed_frames_are_refused() {
    let d = decode(&["--handoff-timeout-ms", "400"]);
    let mismatch = |reason: &str| format!(r#"kvgate_handoff_mismatch_total{{reason="{reason}",role="decode"}}"#);

    // A client that learned a handoff id but not the secret cannot mint its tag.
    let c = KvClient::reserve(&d, 20).await;
    let (ok, reason, _) = c.send(&[c.page(0, [0x5a; 32], c.id())]).await;
    assert!(!ok);
    assert_eq!(reason, "auth");
    assert_eq!(d.metric(&mismatch("auth")).await, 1.0);

    // A handoff id decode never issued.
    let c = KvClient::reserve(&d, 20).await;
    let (ok, reason, message) = c.send(&[c.page(0, c.tag(), HandoffId(12345))]).await;
    assert!(!ok);
    assert_eq!(reason, "unknown_handoff", "{message}");

    // A reservation whose time ran out.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let (ok, reason, _) = c.send(&[c.page(0, c.tag(), c.id()), c.page(1, c.tag(), c.id())]).await;
    assert!(!ok);
    assert_eq!(reason, "timeout");
    assert!(d.metric(r#"kvgate_handoff_reservations_expired_total{role="decode"}"#).await >= 1.0);

    // A complete, well-formed transfer commits; replaying its commit is refused.
    let c = KvClient::reserve(&d, 20).await;
    let (ok, reason, message) = c.send(&[c.page(0, c.tag(), c.id()), c.page(1, c.tag(), c.id()), c.commit()]).await;
    assert!(ok, "{reason}: {message}");
    let (ok, reason, message) = c.send(&[c.commit()]).await;
    assert!(!ok);
    assert_eq!(reason, "unknown_handoff");
    assert!(message.contains("already committed"), "{message}");
    assert_eq!(d.metric(r#"kvgate_handoff_total{outcome="committed",role="decode"}"#).await, 1.0);

    // Nobody decodes the committed handoff: its pages are freed at the deadline all the same.
    eventually(&d, r#"kvgate_kv_pool_pages_in_use{role="decode"}"#, 0.0).await;
    assert_eq!(d.metric(r#"kvgate_generation_tokens_total{role="decode"}"#).await, 0.0);
}

#[tokio::test]
async fn fault_injection_needs_its_safety_flag() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate-worker"))
        .args(["prefill", "--inject-fault", "truncate-transfer"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--allow-fault-injection"));
}
