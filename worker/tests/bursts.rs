//! Bursts of honest requests through split roles (router, prefill and decode as processes over
//! loopback) never fail: every request of a burst of 24, 48 or 96, each from an address of its
//! own, is answered 200, or 429/503 with `Retry-After` where a documented cap says so; never
//! 502. One prefill opens one KV connection per handoff, so a burst is a burst of new
//! connections from one address at decode's KV port (`server/places.rs`); a peer that fails
//! before any byte reached the client is tried again (`roles/retry.rs`).

mod support;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::json;
use support::{Cluster, Worker, cluster_with, connect_from};
use tokio::io::AsyncReadExt;

/// One answer: its status, and whether it said when to come back.
struct Answer {
    status: u16,
    retry_after: bool,
    body: String,
}

/// `n` greedy completions at once, the i-th from 127.0.0.(10 + i).
async fn burst(router: &Worker, n: usize, max_tokens: u32) -> Vec<Answer> {
    let requests = (0..n).map(|i| {
        let url = format!("{}/v1/completions", router.base);
        async move {
            let from = IpAddr::from([127, 0, 0, 10 + i as u8]);
            let http = reqwest::Client::builder().local_address(from).timeout(Duration::from_secs(120)).build().unwrap();
            let body = json!({"prompt": format!("request {i} of a burst, from a client of its own"), "max_tokens": max_tokens, "temperature": 0});
            match http.post(url).json(&body).send().await {
                Ok(r) => {
                    let status = r.status().as_u16();
                    let retry_after = r.headers().contains_key("retry-after");
                    Answer { status, retry_after, body: r.text().await.unwrap_or_default() }
                }
                Err(e) => Answer { status: 0, retry_after: false, body: format!("no answer: {e}") },
            }
        }
    });
    futures::future::join_all(requests).await
}

/// Every answer is a 200, or a documented refusal that says when to come back.
fn assert_never_failed(what: &str, answers: &[Answer]) {
    let mut by_status: BTreeMap<u16, usize> = BTreeMap::new();
    for a in answers {
        *by_status.entry(a.status).or_default() += 1;
    }
    eprintln!("{what}: {by_status:?}");
    let failed: Vec<String> = answers
        .iter()
        .filter(|a| !(a.status == 200 || (matches!(a.status, 429 | 503) && a.retry_after)))
        .map(|a| format!("HTTP {} (Retry-After: {}): {}", a.status, a.retry_after, a.body))
        .collect();
    assert!(failed.is_empty(), "{what}: {} of {} failed: {failed:#?}", failed.len(), answers.len());
    assert!(by_status.get(&200).copied().unwrap_or(0) * 2 >= answers.len(), "{what}: most of a burst inside every cap is served: {by_status:?}");
}

async fn assert_no_integrity_event(c: &Cluster) {
    assert_eq!(c.decode.family_sum("kvgate_handoff_mismatch_total").await, 0.0, "a burst is not an integrity event");
}

#[tokio::test]
async fn bursts_of_24_48_and_96_concurrent_requests_are_all_answered() {
    // Pools for 96 requests at once (each reserves its prompt and 16 tokens).
    let pool = ["--kv-pool-tokens", "32768"];
    let c = cluster_with(&pool, &pool, &[]);
    for n in [24, 48, 96] {
        let answers = burst(&c.router, n, 16).await;
        assert_never_failed(&format!("burst of {n}"), &answers);
    }
    let retries = c.router.family_sum("kvgate_router_retries_total").await;
    let mut closed = Vec::new();
    for listener in ["kv", "http"] {
        for reason in ["client_limit", "connection_limit", "evicted"] {
            let series = format!(r#"kvgate_connections_refused_total{{listener="{listener}",reason="{reason}",role="decode"}}"#);
            closed.push((listener, reason, c.decode.metric(&series).await));
        }
    }
    eprintln!("bursts: router retries {retries}; decode closed {closed:?}");
    // Every KV connection of a burst comes from the one prefill and sends its frame at once: none
    // is ever refused. (The router's HTTP client may open a spare connection it then leaves
    // silent, which a full pool closes after the grace; no request rides on it.)
    let kv_refused: f64 = closed.iter().filter(|(l, r, _)| *l == "kv" && *r != "evicted").map(|(_, _, n)| n).sum();
    assert_eq!(kv_refused, 0.0, "decode's KV port refused a peer's connection: {closed:?}");
    assert_no_integrity_event(&c).await;
}

/// `count` connections from 127.0.0.1, the address the roles talk to each other from, each
/// sending nothing and reopened when closed, until `stop`.
async fn idle_from_the_peers_address(to: SocketAddr, count: usize, stop: Arc<AtomicBool>) {
    let tasks: Vec<_> = (0..count)
        .map(|_| {
            let stop = stop.clone();
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let Ok(mut s) = connect_from(1, to).await else {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    };
                    let mut buf = [0u8; 64];
                    loop {
                        tokio::select! {
                            r = s.read(&mut buf) => if matches!(r, Ok(0) | Err(_)) { break },
                            _ = tokio::time::sleep(Duration::from_millis(100)) => if stop.load(Ordering::SeqCst) { return },
                        }
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
}

// A stranger at the peers' own address (pods with `hostNetwork` on one node share one) holds
// 300 idle sockets on each internal port (decode's KV port and HTTP port, prefill's HTTP port),
// reopening each as it is closed: a burst is served all the same. Silent newcomers are closed
// after a short grace, idle holders give their places up to newcomers that sent something.
#[tokio::test]
async fn idle_sockets_from_the_peers_own_address_leave_every_internal_port_to_the_peers() {
    let c = cluster_with(&[], &["--kv-auth-timeout-ms", "500"], &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let ports = [c.decode.kv_addr(), c.decode.addr(), c.prefill.addr()];
    let attacks: Vec<_> = ports.into_iter().map(|to| tokio::spawn(idle_from_the_peers_address(to, 300, stop.clone()))).collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let answers = burst(&c.router, 24, 8).await;
    stop.store(true, Ordering::SeqCst);
    for attack in attacks {
        let _ = tokio::time::timeout(Duration::from_secs(20), attack).await;
    }
    let refused = |w: &'static str, listener: &'static str, reason: &'static str| {
        format!(r#"kvgate_connections_refused_total{{listener="{listener}",reason="{reason}",role="{w}"}}"#)
    };
    for (w, role, listener) in [(&c.decode, "decode", "kv"), (&c.decode, "decode", "http"), (&c.prefill, "prefill", "http")] {
        let mut seen = Vec::new();
        for reason in ["evicted", "client_limit", "connection_limit", "unauthenticated"] {
            seen.push(format!("{reason} {}", w.metric(&refused(role, listener, reason)).await));
        }
        eprintln!("{role}'s {listener} port under 300 idle sockets from the peers' address: {}", seen.join(", "));
        assert!(w.metric(&refused(role, listener, "client_limit")).await > 0.0, "{role} {listener}: silent sockets past the share were closed and counted");
    }
    assert_never_failed("burst of 24 beside 300 idle sockets per internal port at the peers' address", &answers);
    assert!(answers.iter().all(|a| a.status == 200), "nothing here is over a cap");
    assert_no_integrity_event(&c).await;
}
