//! A decode's KV port and reservation table over a given pool, and a prefill pool holding one
//! prompt's pages to send to it: the handoff as the roles run it, minus HTTP. Shared by the
//! benches that time handoffs (`handoff`) and that run them beside a busy engine (`contention`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_proto::roles::Reservation;
use kvgate_worker::handoff::reservations::{Limits, TableConfig};
use kvgate_worker::handoff::sender::{SendOutcome, Transfer};
use kvgate_worker::handoff::{HandoffMetrics, Reservations, Secret, receiver};
use kvgate_worker::kv::{KvLayout, KvPool, Lease};
use tokio::net::TcpListener;

pub struct Rig {
    pub table: Arc<Reservations>,
    secret: Secret,
    kv_addr: String,
    metrics: HandoffMetrics,
    prefill_pool: Arc<KvPool>,
    lease: Lease,
    tokens: usize,
    checks: bool,
}

impl Rig {
    /// A receiver on a loopback port writing into `decode_pool`, and `tokens` prompt tokens of
    /// patterned pages on the prefill side. `checks`: every integrity check, or none.
    pub async fn new(decode_pool: Arc<KvPool>, tokens: usize, window: usize, checks: bool) -> Rig {
        let l: KvLayout = *decode_pool.layout();
        let pages = l.pages_for(tokens);
        let prefill_pool = KvPool::host(l, pages).unwrap();
        let registry = prometheus::Registry::new();
        let metrics = HandoffMetrics::new(&registry, "bench");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let kv_addr = listener.local_addr().unwrap().to_string();
        let secret = Secret::random();
        let config = TableConfig {
            timeout: Duration::from_secs(60),
            limits: Limits { window, vocab: 256, max_open: 64 },
            kv_addr: kv_addr.clone(),
            model_fingerprint: "0000000000000001".into(),
            layout_fingerprint: "0000000000000002".into(),
        };
        let table = Reservations::new(decode_pool, secret.clone(), config, metrics.clone()).unwrap();
        let table = Arc::new(if checks { table } else { table.without_integrity_checks() });
        let port = receiver::PortLimits {
            max_connections: 64,
            max_unauthenticated: 64,
            max_unauthenticated_per_client: 64,
            auth_timeout: Duration::from_secs(10),
            frame_timeout: Duration::from_secs(10),
        };
        let refusals = kvgate_worker::listener::Refusals::new(&registry, "bench");
        tokio::spawn(receiver::serve(listener, table.clone(), port, refusals));
        let lease = prefill_pool.lease(tokens).unwrap();
        let page: Vec<u8> = (0..l.page_bytes()).map(|i| (i * 31 % 251) as u8).collect();
        for i in 0..pages {
            prefill_pool.write_page_at(&lease, i, 0, &page).unwrap();
        }
        Rig { table, secret, kv_addr, metrics, prefill_pool, lease, tokens, checks }
    }

    /// Reserves, sends and commits one handoff, then frees its pages as a finished decode
    /// would; returns how long the transfer took (reservation to ack).
    pub async fn send_one(&self) -> Duration {
        let issued = self.table.reserve(self.tokens as u32, 1, &kvgate_proto::tenant_id::TenantId::parse("bench").unwrap()).unwrap();
        let reservation = Reservation {
            handoff_id: issued.id,
            pages: issued.pages.clone(),
            reserved_tokens: issued.reserved_tokens,
            max_tokens: issued.max_tokens,
            expires_ms: issued.expires_ms,
            tag: issued.tag,
            kv_addr: self.kv_addr.clone(),
            model_fingerprint: "0000000000000001".into(),
            layout_fingerprint: "0000000000000002".into(),
            tenant: issued.tenant.clone(),
        };
        let transfer = Transfer {
            pool: &self.prefill_pool,
            lease: &self.lease,
            prompt_tokens: self.tokens,
            reservation: &reservation,
            tenant: issued.tenant.tag(),
            secret: &self.secret,
            first_token: 0,
            first_logprobs: None,
            model_fingerprint: "0000000000000001",
            layout_fingerprint: "0000000000000002",
            metrics: &self.metrics,
        };
        let t = Instant::now();
        let sent = if self.checks { transfer.run().await } else { transfer.run_without_integrity().await };
        match sent.unwrap() {
            SendOutcome::Acked(a) => assert!(a.ok(), "{}", a.message),
            SendOutcome::Died => unreachable!("the receiver is in this process"),
        }
        let took = t.elapsed();
        drop(self.table.take_committed(issued.id, None, &issued.tenant).await.unwrap());
        took
    }
}
