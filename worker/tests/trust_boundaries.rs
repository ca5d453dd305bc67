//! Trust boundaries, tried from outside as an attacker and as a heavy user would: every call,
//! frame and body is written by hand (no injected fault). Each test reproduces one row of the
//! table in the issue that introduced it (numbers in the test names' comments), shows it refused,
//! counted under the right metric, and harmless to honest requests running beside it.

mod support;

use std::time::Duration;

use futures::future::join_all;
use kvgate_proto::auth::ReservationFields;
use kvgate_proto::handoff::{AckFrame, Frame, HEADER_LEN, HandoffId, TenantTag, parse_header};
use kvgate_proto::roles::Reservation;
use kvgate_worker::kv::{KvDtype, KvLayout};
use serde_json::{Value, json};
use support::kv::{KvClient, send_raw};
use support::{TestSecret, Worker, cluster, cluster_with, connect_from, decode, eventually};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use xxhash_rust::xxh3::xxh3_128;

fn rejected(role: &str, reason: &str) -> String {
    format!(r#"kvgate_internal_requests_rejected_total{{reason="{reason}",role="{role}"}}"#)
}

fn mismatch(reason: &str) -> String {
    format!(r#"kvgate_handoff_mismatch_total{{reason="{reason}",role="decode"}}"#)
}

fn kv_port(reason: &str) -> String {
    format!(r#"kvgate_kv_port_rejected_total{{reason="{reason}",role="decode"}}"#)
}

/// Sum of every integrity mismatch reason on decode.
async fn mismatches(w: &Worker) -> f64 {
    let (_, text) = w.get("/metrics").await;
    text.lines()
        .filter(|l| l.starts_with("kvgate_handoff_mismatch_total{") && l.contains(r#"role="decode""#))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

/// Greedy completions of `prompts`, all at once.
async fn complete_all(w: &Worker, prompts: &[String], max_tokens: u32) -> Vec<String> {
    join_all(prompts.iter().map(|p| w.complete(p, max_tokens))).await
}

fn victims() -> Vec<String> {
    (0..4).map(|i| format!("victim {i}: a tenant's honest request that must come out exactly as colocated")).collect()
}

// Row 1: the internal API and prefill's dialing.
#[tokio::test]
async fn internal_endpoints_refuse_callers_without_the_deployment_secret() {
    let c = cluster(&[], &[]);
    let reserve = json!({"prompt_tokens": 4, "max_tokens": 4, "tenant": "acme"});
    let id = "0".repeat(32);
    let calls = [
        (&c.decode, "decode", "/internal/v1/reserve".to_string(), reserve.clone()),
        (&c.decode, "decode", format!("/internal/v1/handoffs/{id}/cancel"), json!({"rejected": false})),
        (
            &c.decode,
            "decode",
            format!("/internal/v1/handoffs/{id}/generate"),
            json!({"prompt": [1], "tenant": "acme", "max_tokens": 1, "sampling": {"temperature": 0.0, "top_p": 1.0, "seed": null}}),
        ),
        (&c.prefill, "prefill", "/internal/v1/prefill".to_string(), json!({"prompt": [1], "reservation": {}})),
    ];
    for (n, (w, role, path, body)) in calls.iter().enumerate() {
        let (status, resp) = w.post(path, body).await;
        assert_eq!(status, 401, "{path}: {resp}");
        assert_eq!(resp["error"]["code"], "unauthenticated", "{path}: {resp}");
        assert!(resp["error"]["message"].as_str().unwrap().contains("x-kvgate-signature"), "{resp}");
        let want = if *role == "decode" { n as f64 + 1.0 } else { 1.0 };
        assert_eq!(w.metric(&rejected(role, "missing")).await, want, "{path}");
    }
    // Signed with another deployment's secret.
    let stranger = TestSecret::new().signer();
    let (status, resp) = c.decode.post_signed(&stranger, "/internal/v1/reserve", &reserve).await;
    assert_eq!(status, 401, "{resp}");
    assert_eq!(c.decode.metric(&rejected("decode", "bad_mac")).await, 1.0);
    // A request the router really signed, captured and sent again.
    let body = serde_json::to_vec(&reserve).unwrap();
    let signature = c.secret.signer().sign("/internal/v1/reserve", c.decode.instance().await, &body);
    let replay = || {
        c.decode
            .http
            .post(format!("{}/internal/v1/reserve", c.decode.base))
            .header("x-kvgate-signature", &signature)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
    };
    assert_eq!(replay().await.unwrap().status(), 200);
    assert_eq!(replay().await.unwrap().status(), 401);
    assert_eq!(c.decode.metric(&rejected("decode", "replayed")).await, 1.0);
    assert_eq!(c.decode.metric(r#"kvgate_kv_pool_pages_in_use{role="decode"}"#).await, 1.0, "only the one authenticated reservation holds a page");

    // Prefill sends KV only where this deployment's decode said: a reservation whose kv_addr was
    // changed (to a listener of ours) no longer carries a valid tag, and nothing dials it.
    let trap = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let kv = KvClient::reserve(&c.decode, &c.secret.signer(), 3, 4).await;
    let mut redirected = kv.reservation.clone();
    redirected.kv_addr = trap.local_addr().unwrap().to_string();
    let (status, resp) = c
        .prefill
        .post_signed(&c.secret.signer(), "/internal/v1/prefill", &json!({"prompt": [256, 104, 105], "tenant": "acme", "reservation": redirected}))
        .await;
    assert_eq!(status, 400, "{resp}");
    assert_eq!(resp["error"]["code"], "reservation_invalid");
    assert!(resp["error"]["message"].as_str().unwrap().contains("does not carry a tag"), "{resp}");
    assert!(tokio::time::timeout(Duration::from_millis(300), trap.accept()).await.is_err(), "prefill dialled the address it was handed");
    assert_eq!(c.prefill.metric(r#"kvgate_kv_pool_pages_in_use{role="prefill"}"#).await, 0.0, "nothing was computed");

    // The deployment's own traffic is unaffected.
    assert!(!c.router.complete("hello", 4).await.is_empty());
    assert_eq!(mismatches(&c.decode).await, 0.0);
}

// Rows 2 and 4: every number checked against the reservation.
#[tokio::test]
async fn reservations_and_generation_are_bounded_by_checked_arithmetic_and_a_cap() {
    let secret = TestSecret::new();
    let d = decode(&[&secret.arg(), "--max-open-reservations", "3"]);
    let signer = secret.signer();
    let field = |resp: &Value| resp["error"]["param"].as_str().unwrap_or_default().to_string();
    // 16 + (2^32 - 1) used to wrap around and reserve a single page.
    let (status, resp) = d.post_signed(&signer, "/internal/v1/reserve", &json!({"prompt_tokens": 16, "max_tokens": u32::MAX, "tenant": "acme"})).await;
    assert_eq!((status, field(&resp)), (400, "max_tokens".into()), "{resp}");
    let (status, resp) = d.post_signed(&signer, "/internal/v1/reserve", &json!({"prompt_tokens": 0, "max_tokens": 4, "tenant": "acme"})).await;
    assert_eq!((status, field(&resp)), (400, "prompt_tokens".into()), "{resp}");
    let (status, resp) = d.post_signed(&signer, "/internal/v1/reserve", &json!({"prompt_tokens": 8000, "max_tokens": 500, "tenant": "acme"})).await;
    assert_eq!(status, 400, "{resp}");
    assert_eq!(resp["error"]["code"], "context_length_exceeded");

    // At most three open reservations.
    let held = [KvClient::reserve(&d, &signer, 20, 4).await, KvClient::reserve(&d, &signer, 1, 1).await, KvClient::reserve(&d, &signer, 1, 1).await];
    let (status, resp) = d.post_signed(&signer, "/internal/v1/reserve", &json!({"prompt_tokens": 1, "max_tokens": 1, "tenant": "acme"})).await;
    assert_eq!(status, 503, "{resp}");
    assert_eq!(resp["error"]["code"], "too_many_reservations");
    assert!(resp["error"]["message"].as_str().unwrap().contains("--max-open-reservations"), "{resp}");

    // A committed handoff generates no more than it reserved, whatever the caller asks.
    let c = held.into_iter().next().unwrap().holding(&secret.secret);
    let mut frames = c.pages();
    frames.push(c.commit(65));
    let (ok, reason, message) = c.send(&frames).await;
    assert!(ok, "{reason}: {message}");
    let prompt: Vec<u32> = (0..20).collect();
    let generate = |max_tokens: u32| json!({"prompt": prompt, "tenant": support::kv::TENANT, "max_tokens": max_tokens, "sampling": {"temperature": 0.0, "top_p": 1.0, "seed": null}});
    let (status, resp) = d.post_signed(&signer, &format!("/internal/v1/handoffs/{}/generate", c.reservation.handoff_id), &generate(u32::MAX)).await;
    assert_eq!((status, field(&resp)), (400, "max_tokens".into()), "{resp}");
    assert!(resp["error"]["message"].as_str().unwrap().contains("4 reserved"), "{resp}");
    assert_eq!(d.metric(r#"kvgate_generation_tokens_total{role="decode"}"#).await, 0.0);
    eventually(&d, r#"kvgate_kv_pool_pages_in_use{role="decode"}"#, 2.0).await; // the two 1-token reservations
}

// Rows 2 and 3, the other half: a bad request fails alone while victims run beside it.
#[tokio::test]
async fn a_forged_first_token_is_refused_at_commit_while_victims_run_exactly() {
    let colocated = Worker::colocated(&[]);
    let want = complete_all(&colocated, &victims(), 24).await;
    let c = cluster(&[], &[]);
    let attack = async {
        let kv = KvClient::reserve(&c.decode, &c.secret.signer(), 20, 4).await.holding(&c.secret.secret);
        let mut frames = kv.pages();
        frames.push(kv.commit(100_000));
        kv.send(&frames).await
    };
    let prompts = victims();
    let (got, (ok, reason, message)) = tokio::join!(complete_all(&c.router, &prompts, 24), attack);
    assert!(!ok);
    assert_eq!(reason, "first_token", "{message}");
    assert!(message.contains("100000"), "{message}");
    assert_eq!(got, want, "the victims' outputs changed");
    assert_eq!(c.decode.metric(&mismatch("first_token")).await, 1.0);
    eventually(&c.decode, r#"kvgate_kv_pool_pages_in_use{role="decode"}"#, 0.0).await;
}

// Row 5: no switch sends a byte of another tenant.
#[tokio::test]
async fn no_byte_of_a_previous_tenant_leaves_prefill_even_without_scrubbing() {
    let secret = TestSecret::new();
    // One page: the second prompt gets exactly the first one's page back, unscrubbed.
    let prefill = Worker::spawn(&["prefill", "--listen", "127.0.0.1:0", "--kv-pool-tokens", "16", "--no-kv-scrub", &secret.arg()]);
    let (_, report) = prefill.get("/v1/kv-pool").await;
    let report: kvgate_proto::CapacityReport = serde_json::from_str(&report).unwrap();
    let sink = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let kv_addr = sink.local_addr().unwrap().to_string();

    // Plays decode for one transfer: mints the reservation, receives the page, acks.
    let transfer = |prompt: Vec<u32>| {
        let (secret, prefill, sink, kv_addr, report) = (&secret, &prefill, &sink, &kv_addr, &report);
        async move {
            let id = HandoffId(rand::random());
            let pages = vec![0u32];
            let expires_ms = kvgate_worker::roles::internal_auth::now_ms() + 30_000;
            let fields = ReservationFields {
                handoff: id,
                reserved_tokens: prompt.len() as u32,
                max_tokens: 4,
                expires_ms,
                pages: &pages,
                kv_addr,
                tenant: TenantTag::of("acme"),
            };
            let reservation = Reservation {
                handoff_id: id,
                pages: pages.clone(),
                reserved_tokens: prompt.len() as u32,
                max_tokens: 4,
                expires_ms,
                tag: secret.secret.key().reservation_tag(&fields),
                kv_addr: kv_addr.clone(),
                model_fingerprint: report.model_fingerprint.clone(),
                layout_fingerprint: report.layout_fingerprint.clone(),
                tenant: kvgate_proto::tenant_id::TenantId::parse("acme").unwrap(),
            };
            let (signer, body) = (secret.signer(), json!({"prompt": prompt, "tenant": "acme", "reservation": reservation}));
            let call = prefill.post_signed(&signer, "/internal/v1/prefill", &body);
            let receive = async {
                let (mut s, _) = sink.accept().await.unwrap();
                let mut payload = Vec::new();
                loop {
                    let mut header = [0u8; HEADER_LEN];
                    s.read_exact(&mut header).await.unwrap();
                    let h = parse_header(&header).unwrap();
                    let mut body = vec![0u8; h.body_len as usize];
                    s.read_exact(&mut body).await.unwrap();
                    let frame = Frame::decode_body(h.kind, &body).unwrap();
                    assert!(frame.mac_verifies(&secret.secret.key().frame_key(id, TenantTag::of("acme")), &header, &body));
                    match frame {
                        Frame::Page(p) => payload = p.payload,
                        Frame::Commit(_) => break,
                        Frame::Ack(_) => unreachable!(),
                    }
                }
                let ack = Frame::Ack(AckFrame::accepted());
                s.write_all(&ack.encode()).await.unwrap();
                payload
            };
            let ((status, resp), payload) = tokio::join!(call, receive);
            assert_eq!(status, 200, "{resp}");
            payload
        }
    };
    let tenant_a: Vec<u32> = std::iter::once(256).chain((0..15).map(|i| 65 + i)).collect();
    let tenant_b = vec![256, 120, 121];
    let a = transfer(tenant_a).await;
    let b = transfer(tenant_b.clone()).await;
    let cfg = kvgate_worker::model::tiny::config();
    let layout = KvLayout { num_layers: cfg.num_hidden_layers, num_kv_heads: cfg.num_kv_heads(), head_dim: cfg.head_dim(), page_size: 16, dtype: KvDtype::F32 };
    assert_eq!(a.len(), layout.page_bytes());
    let (mut tail, mut a_nonzero, mut leaked) = (0, 0, 0);
    for r in layout.unwritten_byte_ranges(tenant_b.len()) {
        for i in r {
            tail += 1;
            a_nonzero += (a[i] != 0) as usize;
            leaked += (b[i] != 0) as usize;
        }
    }
    assert!(a_nonzero > tail / 2, "tenant A's KV should fill the slots B does not use ({a_nonzero} of {tail} nonzero)");
    assert_eq!(leaked, 0, "{leaked} of {tail} bytes past B's prompt were sent");
}

// Row 6: integrity an on-path attacker cannot forge.
#[tokio::test]
async fn a_page_rewritten_on_the_path_is_refused_by_its_tag_or_its_mac() {
    let c = cluster(&[], &[]);
    let rewritten = |honest: Vec<u8>, new_tag: bool| {
        let Frame::Page(mut page) = Frame::decode(&honest).unwrap().0 else { unreachable!() };
        page.payload[7] ^= 0x40;
        if new_tag {
            // Without the handoff's keys the best an attacker can do is a fresh checksum.
            page.tag = xxh3_128(&page.payload);
        }
        Frame::Page(page).encode()
    };
    // The attacker sees the frame and changes the KV: the tag, keyed per handoff, no longer
    // matches the payload.
    let kv = KvClient::reserve(&c.decode, &c.secret.signer(), 20, 4).await.holding(&c.secret.secret);
    let (ok, reason, message) = send_raw(&kv.reservation.kv_addr, &[rewritten(kv.page(0, kv.id()), false)]).await;
    assert!(!ok);
    assert_eq!(reason, "checksum", "{message}");
    assert_eq!(c.decode.metric(&mismatch("checksum")).await, 1.0);
    // It replaces the tag too: the MAC, over the tag, no longer holds.
    let kv = KvClient::reserve(&c.decode, &c.secret.signer(), 20, 4).await.holding(&c.secret.secret);
    let (ok, reason, message) = send_raw(&kv.reservation.kv_addr, &[rewritten(kv.page(0, kv.id()), true)]).await;
    assert!(!ok);
    assert_eq!(reason, "auth", "{message}");
    assert_eq!(c.decode.metric(&mismatch("auth")).await, 1.0);
    eventually(&c.decode, r#"kvgate_kv_pool_pages_in_use{role="decode"}"#, 0.0).await;
    // One who knows a live handoff id but not the secret cannot write into it either.
    let live = KvClient::reserve(&c.decode, &c.secret.signer(), 20, 4).await;
    let (ok, reason, _) = live.send(&[live.page(0, live.id())]).await;
    assert!(!ok);
    assert_eq!(reason, "auth");
    assert_eq!(c.decode.metric(&mismatch("auth")).await, 2.0);
}

// Row 7: a KV port that survives abuse: strangers get a few slots per address and a short
// deadline to authenticate; a peer holding the secret is served beside them.
#[tokio::test]
async fn the_kv_port_caps_connections_and_closes_slow_peers() {
    let secret = TestSecret::new();
    let d = decode(&[&secret.arg(), "--kv-max-unauthenticated-per-client", "4", "--kv-auth-timeout-ms", "300"]);
    let kv = KvClient::reserve(&d, &secret.signer(), 20, 4).await.holding(&secret.secret);
    let addr = kv.reservation.kv_addr.clone();
    // Ten connections from one address: nine silent ones, four of which take the strangers'
    // places while the five past the share are closed after the grace; then one that sends
    // half a header, which takes the place of an idle one. None ever authenticates, so each
    // is closed and counted once: silent past the share, evicted, or timed out reading.
    let kv_refused = |reason: &str| format!(r#"kvgate_connections_refused_total{{listener="kv",reason="{reason}",role="decode"}}"#);
    let mut held = Vec::new();
    for _ in 0..9 {
        held.push(TcpStream::connect(&addr).await.unwrap());
    }
    eventually(&d, &kv_refused("client_limit"), 5.0).await;
    let mut speaker = TcpStream::connect(&addr).await.unwrap();
    speaker.write_all(b"KVGF").await.unwrap();
    held.push(speaker);
    let mut closed = 0.0;
    for _ in 0..100 {
        closed = 0.0;
        for reason in ["evicted", "client_limit", "unauthenticated"] {
            closed += d.metric(&kv_refused(reason)).await;
        }
        if closed >= 10.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(closed, 10.0, "each connection is closed and counted once");
    assert_eq!(d.metric(&kv_refused("client_limit")).await, 5.0, "the silent ones past the share");
    assert_eq!(d.metric(&kv_refused("evicted")).await, 1.0, "the one that spoke took an idle stranger's place");
    eventually(&d, &kv_port("read_timeout"), 4.0).await;
    for mut s in held.drain(..) {
        // Closed by the server (after its refusal, for one that was read).
        let ended = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut Vec::new())).await;
        assert!(ended.is_ok(), "the server closed every silent connection");
    }
    // The port still serves an honest transfer, and none of it was an integrity event.
    let mut frames = kv.pages();
    frames.push(kv.commit(65));
    let (ok, reason, message) = kv.send(&frames).await;
    assert!(ok, "{reason}: {message}");
    assert_eq!(mismatches(&d).await, 0.0);
}

#[tokio::test]
async fn out_of_file_descriptors_the_kv_port_backs_off_instead_of_spinning() {
    let secret = TestSecret::new();
    let log = std::env::temp_dir().join(format!("kvgate-fd-{}.log", std::process::id()));
    let mut cmd = std::process::Command::new("bash");
    cmd.args(["-c", "ulimit -n 64 && exec \"$0\" \"$@\"", Worker::bin(), "decode", "--listen", "127.0.0.1:0", "--kv-listen", "127.0.0.1:0"])
        .arg(secret.arg())
        .stderr(std::fs::File::create(&log).unwrap());
    let d = Worker::from_command(cmd);
    let kv = KvClient::reserve(&d, &secret.signer(), 20, 4).await;
    // Eight strangers' connections per address are held and the rest wait for a place until
    // the deadline: sixteen addresses hold more than the 64 descriptors.
    let addr = kv.reservation.kv_addr.parse().unwrap();
    let mut held = Vec::new();
    for i in 0..128 {
        if let Ok(s) = connect_from(2 + (i % 16) as u8, addr).await {
            held.push(s);
        }
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let text = std::fs::read_to_string(&log).unwrap();
    let warnings = text.lines().filter(|l| l.contains("accepting a KV connection failed")).count();
    assert!((1..=3).contains(&warnings), "{warnings} accept warnings in 3 s (rate-limited to one per 5 s):\n{}", &text[text.len().saturating_sub(2000)..]);
    drop(held);
    // Once descriptors are free again it serves as before.
    let (_, health) = d.get("/healthz").await;
    assert_eq!(health, "ok\n");
    std::fs::remove_file(log).unwrap();
}

// Row 8: garbage is protocol noise, idle reservations only expire; neither fires the alert.
#[tokio::test]
async fn garbage_and_idle_reservations_never_count_as_integrity_mismatches() {
    let secret = TestSecret::new();
    let d = decode(&[&secret.arg(), "--handoff-timeout-ms", "300"]);
    let kv = KvClient::reserve(&d, &secret.signer(), 20, 4).await;
    let valid = kv.page(0, kv.id());
    let with = |at: usize, bytes: &[u8]| {
        let mut v = valid.clone();
        v[at..at + bytes.len()].copy_from_slice(bytes);
        v
    };
    let mut trailing = valid.clone();
    trailing.extend_from_slice(b"junk");
    let len = (trailing.len() - HEADER_LEN) as u32;
    trailing[8..12].copy_from_slice(&len.to_le_bytes());
    let cases = [
        (with(0, b"HTTP"), "malformed"),
        (with(4, &9u16.to_le_bytes()), "malformed"),
        (with(6, &[7]), "malformed"),
        (with(8, &u32::MAX.to_le_bytes()), "too_large"),
        (with(8, &(50u32 << 20).to_le_bytes()), "too_large"),
        (trailing, "malformed"),
        // A well-formed frame for a handoff id nobody issued, without the secret's MAC.
        (kv.page(0, HandoffId(42)), "unauthenticated"),
    ];
    for (bytes, want) in &cases {
        let (ok, reason, message) = send_raw(&kv.reservation.kv_addr, std::slice::from_ref(bytes)).await;
        assert!(!ok);
        assert_eq!(reason, *want, "{message}");
    }
    assert_eq!(d.metric(&kv_port("malformed")).await, 4.0);
    assert_eq!(d.metric(&kv_port("too_large")).await, 2.0);
    assert_eq!(d.metric(&kv_port("unauthenticated")).await, 1.0);
    // Reserving and never sending anything: expired, not a timeout mismatch.
    for _ in 0..5 {
        KvClient::reserve(&d, &secret.signer(), 20, 4).await;
    }
    eventually(&d, r#"kvgate_handoff_reservations_expired_total{role="decode"}"#, 6.0).await;
    assert_eq!(mismatches(&d).await, 0.0, "no integrity mismatch from garbage or idle clients");
    eventually(&d, r#"kvgate_kv_pool_pages_in_use{role="decode"}"#, 0.0).await;
}

// Row 9: the declared window really works.
#[tokio::test]
async fn a_body_over_two_megabytes_inside_the_window_is_served_and_one_past_the_limit_is_a_json_413() {
    let w = Worker::local(&["--context-window", "1048576", "--kv-pool-tokens", "4096"]);
    let mut body = r#"{"prompt": "Hello", "max_tokens": 2, "temperature": 0"#.to_string();
    body.push_str(&" ".repeat(3 << 20));
    body.push('}');
    let (status, resp) = w.post_raw("/v1/completions", &body).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["usage"]["completion_tokens"], 2);
    let limit = (1 << 20) + 16 * 1_048_576;
    let huge = format!(r#"{{"prompt": "{}", "max_tokens": 2}}"#, "x".repeat(limit));
    let (status, resp) = w.post_raw("/v1/completions", &huge).await;
    assert_eq!(status, 413, "{resp}");
    assert_eq!(resp["error"]["code"], "request_too_large");
    assert_eq!(resp["error"]["param"], "body");
    assert!(resp["error"]["message"].as_str().unwrap().contains(&limit.to_string()), "{resp}");
    assert_eq!(w.metric(r#"kvgate_requests_total{code="413",role="router"}"#).await, 1.0);
}

#[tokio::test]
async fn a_prompt_of_600k_tokens_reaches_prefill_and_is_rejected_there_as_too_large_for_its_pool() {
    let window = ["--context-window", "1048576"];
    let c = cluster_with(
        &[window[0], window[1], "--kv-pool-tokens", "4096", "--kv-dtype", "bf16"],
        &[window[0], window[1], "--kv-pool-tokens", "1100000", "--kv-dtype", "bf16"],
        &window,
    );
    let prompt = "x".repeat(600_000);
    let (status, resp) = c.router.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 4})).await;
    assert_eq!(status, 413, "{resp}");
    assert_eq!(resp["error"]["code"], "prompt_too_large", "{resp}");
    let message = resp["error"]["message"].as_str().unwrap();
    assert!(message.contains("600001") && message.contains("4096"), "{message}");
    assert_eq!(c.router.metric(r#"kvgate_requests_rejected_total{reason="prompt_too_large",role="router"}"#).await, 1.0);
    assert_eq!(c.prefill.metric(r#"kvgate_requests_rejected_total{reason="prompt_too_large",role="prefill"}"#).await, 1.0);
    assert_eq!(c.prefill.metric(&rejected("prefill", "too_large")).await, 0.0, "the body fitted the window's limit");
    assert_eq!(c.decode.metric(r#"kvgate_handoff_total{outcome="rejected",role="decode"}"#).await, 1.0);
    assert_eq!(c.decode.metric(r#"kvgate_kv_pool_pages_in_use{role="decode"}"#).await, 0.0);
}

// Row 10: deadlines enforced when a frame arrives.
#[tokio::test]
async fn a_frame_after_the_reservation_expired_is_refused() {
    let secret = TestSecret::new();
    let d = decode(&[&secret.arg(), "--handoff-timeout-ms", "200"]);
    let kv = KvClient::reserve(&d, &secret.signer(), 20, 4).await.holding(&secret.secret);
    let mut s = TcpStream::connect(&kv.reservation.kv_addr).await.unwrap();
    s.write_all(&kv.page(0, kv.id())).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let _ = s.write_all(&kv.page(1, kv.id())).await;
    let mut header = [0u8; HEADER_LEN];
    s.read_exact(&mut header).await.unwrap();
    let mut body = vec![0u8; parse_header(&header).unwrap().body_len as usize];
    s.read_exact(&mut body).await.unwrap();
    let Frame::Ack(ack) = Frame::decode_body(header[6], &body).unwrap() else { panic!() };
    assert_eq!(ack.refused.map(|r| r.as_str()), Some("timeout"), "{}", ack.message);
    assert_eq!(d.metric(&mismatch("timeout")).await, 1.0, "a transfer that stopped half way is a mismatch");
}

// Row 11: a full decode pool makes reservations wait, as colocated admission does.
#[tokio::test]
async fn a_full_decode_pool_makes_reservations_wait_instead_of_answering_503() {
    let colocated = Worker::colocated(&[]);
    let prompts: Vec<String> = (0..8).map(|i| format!("request {i} waits its turn for pages")).collect();
    let want = complete_all(&colocated, &prompts, 12).await;
    // Each request needs 3 of the 4 pages: they can only run one at a time.
    let c = cluster(&["--kv-pool-tokens", "64"], &["--kv-pool-tokens", "64"]);
    assert_eq!(complete_all(&c.router, &prompts, 12).await, want);
    assert_eq!(c.decode.metric(r#"kvgate_requests_rejected_total{reason="pool_busy",role="decode"}"#).await, 0.0);
}

// Row 12: the first token ends a request in split roles exactly as it does colocated.
#[tokio::test]
async fn split_roles_finish_on_the_first_token_as_colocated_does() {
    let colocated = Worker::colocated(&[]);
    let split = Worker::local(&[]);
    let mut stopped_at_once = 0;
    // The first five end at their first token on the tiny model (its weights are the same on
    // every machine); the others do not.
    let mut prompts: Vec<String> =
        ["x world zz the to !", "world zz x zz x the to a page", "zz of", "x decode page ! decode ! to", "prompt world x decode cat of x a of"]
            .map(String::from)
            .to_vec();
    prompts.extend((0..10).map(|i| format!("p{i}{}", "?".repeat(i % 7))));
    for prompt in prompts {
        for max_tokens in [1, 8] {
            let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
            let (s1, a) = colocated.post("/v1/completions", &body).await;
            let (s2, b) = split.post("/v1/completions", &body).await;
            assert_eq!((s1, s2), (200, 200));
            let outcome = |v: &Value| (v["choices"][0]["text"].clone(), v["choices"][0]["finish_reason"].clone(), v["usage"]["completion_tokens"].clone());
            assert_eq!(outcome(&b), outcome(&a), "{prompt:?} max_tokens {max_tokens}");
            assert!(b["usage"]["completion_tokens"].as_u64().unwrap() <= max_tokens);
            if max_tokens == 8 && a["choices"][0]["finish_reason"] == "stop" && a["usage"]["completion_tokens"] == 1 {
                stopped_at_once += 1;
            }
        }
    }
    assert_eq!(stopped_at_once, 5, "the prompts chosen to end at their first token no longer do: choose others");
}

// Row 12, continued: `ignore_eos` (vLLM's extension, which load generators send) generates past
// the end-of-sequence token to `max_tokens`, split exactly as colocated; a wrong type is a 400.
#[tokio::test]
async fn ignore_eos_generates_to_max_tokens_split_as_colocated() {
    let colocated = Worker::colocated(&[]);
    let split = Worker::local(&[]);
    let prompt = "x world zz the to !"; // ends at its first token (above)
    let body = |ignore_eos: bool| json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": ignore_eos});
    let (status, stops) = colocated.post("/v1/completions", &body(false)).await;
    assert_eq!((status, stops["choices"][0]["finish_reason"].as_str()), (200, Some("stop")), "{stops}");
    let (s1, a) = colocated.post("/v1/completions", &body(true)).await;
    let (s2, b) = split.post("/v1/completions", &body(true)).await;
    assert_eq!((s1, s2), (200, 200), "{a} {b}");
    assert_eq!(a["usage"]["completion_tokens"], 8, "{a}");
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    assert_eq!(b["choices"][0], a["choices"][0]);
    let (status, chat) =
        split.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "ignore_eos": true})).await;
    assert_eq!((status, chat["usage"]["completion_tokens"].as_u64()), (200, Some(8)), "{chat}");
    let (status, bad) = split.post("/v1/completions", &json!({"prompt": prompt, "ignore_eos": "yes"})).await;
    assert_eq!((status, bad["error"]["param"].as_str()), (400, Some("ignore_eos")), "{bad}");
}

// Row 13: liveness says "this process works", readiness "it can serve".
#[tokio::test]
async fn a_router_without_peers_is_alive_but_not_ready() {
    let secret = TestSecret::new();
    let router = Worker::spawn(&["router", "--listen", "127.0.0.1:0", "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9", &secret.arg()]);
    assert_eq!(router.get("/healthz").await, (200, "ok\n".to_string()));
    assert_eq!(router.get("/readyz").await.0, 503);
}

#[tokio::test]
async fn the_split_roles_refuse_to_start_without_the_deployment_secret() {
    for args in [vec!["router", "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9"], vec!["prefill"], vec!["decode"]] {
        let out = std::process::Command::new(Worker::bin()).args(&args).env_remove("KVGATE_HANDOFF_SECRET_FILE").output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("--handoff-secret-file"), "{args:?}: {stderr}");
    }
}

// Rows 2 and 3 at the engine: a sequence that writes past its lease or carries a token outside
// the vocabulary fails alone; the sequences batched with it produce what they produce alone.
#[tokio::test]
async fn one_bad_sequence_fails_alone_and_its_batch_goes_on() {
    use std::sync::Arc;

    use kvgate_worker::engine::{Engine, Event, Mode, SchedulerConfig};
    use kvgate_worker::kv::KvPool;
    use kvgate_worker::metrics::Metrics;
    use kvgate_worker::model::{Model, SamplingParams};

    let model = Arc::new(Model::tiny(&candle_core::Device::Cpu).unwrap());
    let pool = KvPool::host(model.kv_layout(16, KvDtype::F32), 64).unwrap();
    let config =
        SchedulerConfig { max_batch_tokens: 4096, admission_timeout: Duration::from_secs(30), stall_limit: 2.0, shared_step: Some(Duration::from_millis(10)) };
    let engine = Engine::start(model.clone(), pool.clone(), 1024, Metrics::new(&prometheus::Registry::new(), "test"), config);
    let greedy = SamplingParams::default();
    let prompts: Vec<Vec<u32>> = victims().iter().map(|v| model.tokenizer.encode(v).unwrap()).collect();
    // Drains one request's events: its tokens, or the failure's message.
    async fn outcome(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Result<Vec<u32>, String> {
        let mut tokens = Vec::new();
        while let Some(e) = rx.recv().await {
            match e {
                Event::Token(t, _) => tokens.push(t),
                Event::PromptLogprobs(_) => {}
                Event::Done { .. } => return Ok(tokens),
                Event::Failed(f) => return Err(f.message),
                Event::Rejected(r) => return Err(r.to_string()),
            }
        }
        Err("no final event".into())
    }
    let mut alone = Vec::new();
    for p in &prompts {
        alone.push(outcome(engine.enqueue(p.clone(), 16, greedy, Mode::Full, "acme")).await.unwrap());
    }
    // Together: the victims, a continuation whose lease ends where its prompt does, and one
    // whose first token is not a token of the model.
    let short = pool.lease(16).unwrap();
    let enough = pool.lease(64).unwrap();
    let prompt16: Vec<u32> = (0..16).collect();
    let mut rxs: Vec<_> = prompts.iter().map(|p| engine.enqueue(p.clone(), 16, greedy, Mode::Full, "acme")).collect();
    let past_lease = engine.enqueue(prompt16.clone(), 8, greedy, Mode::Continue { lease: short, first_token: 65, first_logprobs: None }, "acme");
    let bad_token = engine.enqueue(prompt16, 8, greedy, Mode::Continue { lease: enough, first_token: 100_000, first_logprobs: None }, "acme");
    let together = join_all(rxs.drain(..).map(outcome)).await;
    let together: Vec<Vec<u32>> = together.into_iter().map(Result::unwrap).collect();
    assert_eq!(together, alone, "a bad sequence changed its batch's output");
    let e = outcome(past_lease).await.unwrap_err();
    assert!(e.contains("past the 16 tokens leased"), "{e}");
    let e = outcome(bad_token).await.unwrap_err();
    assert!(e.contains("outside the vocabulary"), "{e}");
    assert!(engine.is_alive());
    // Every page came back.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(pool.used_pages(), 0);
}
