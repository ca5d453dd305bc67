//! The workers' HTTP listeners: an accept loop of our own over axum's router, because every port
//! is reachable by whoever is on the pod network. A connection needs a slot (a total cap and one
//! per client address, so one peer cannot take them all); a connection that sends no request
//! head within the idle deadline (an idle keep-alive, a slow header) is closed; refusals are
//! counted in `kvgate_connections_refused_total`, not as failed requests; accepting backs off
//! when it fails (out of descriptors) instead of spinning.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus::{IntCounterVec, Registry};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;

use super::shares::{Full, Share, Shares};
use crate::metrics::RoleRegistry;

/// The client's address, as a request extension (per-client limits read it).
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub SocketAddr);

/// Connection limits of one listener.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Connections open at once; more are closed as soon as they are accepted.
    pub max_connections: usize,
    /// Connections one client address may hold.
    pub per_client: usize,
    /// Longest a connection may wait for (or take to send) a request head.
    pub idle: Duration,
}

/// Why a connection was refused (`reason` of `kvgate_connections_refused_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr, strum::VariantArray)]
#[strum(serialize_all = "snake_case")]
pub enum Saturation {
    /// Every slot of the listener is taken.
    ConnectionLimit,
    /// This client address holds its share already.
    ClientLimit,
    /// A KV connection sent no authentic frame in time (see `handoff::receiver`).
    Unauthenticated,
}

/// The listeners a role has (`listener` of `kvgate_connections_refused_total`).
pub const LISTENERS: [&str; 2] = ["http", "kv"];

/// `kvgate_connections_refused_total{listener, reason}`: saturation, apart from request and
/// handoff outcomes (a full port is its own alert).
#[derive(Clone)]
pub struct Refusals(IntCounterVec);

impl Refusals {
    pub fn new(registry: &Registry, role: &str) -> Self {
        let reasons: Vec<&str> = <Saturation as strum::VariantArray>::VARIANTS.iter().map(|s| s.into()).collect();
        Refusals(RoleRegistry { registry, role }.counter_grid(
            "kvgate_connections_refused_total",
            "Connections a listener closed unserved: over its cap, over one client's share, or (KV port) silent past the authentication deadline.",
            ["listener", "reason"],
            &LISTENERS,
            &reasons,
        ))
    }

    pub fn count(&self, listener: &str, why: Saturation) {
        self.0.with_label_values(&[listener, why.into()]).inc();
    }
}

/// Connection slots: a total and a share per client address.
pub type Slots = Shares<IpAddr>;
/// One connection's slot, returned when dropped.
pub type Slot = Share<IpAddr>;

/// Takes a connection's slot, or says which cap refused it.
fn take_slot(slots: &Arc<Slots>, ip: IpAddr) -> Result<Slot, Saturation> {
    slots.take(ip).map_err(|full| match full {
        Full::Total => Saturation::ConnectionLimit,
        Full::Key => Saturation::ClientLimit,
    })
}

/// Logs at most one line per interval, saying how many were held back.
#[derive(Default)]
struct RateLimitedLog {
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimitedLog {
    const EVERY: Duration = Duration::from_secs(5);

    fn warn(&mut self, what: &str, error: &std::io::Error) {
        if self.last.is_some_and(|t| t.elapsed() < Self::EVERY) {
            self.suppressed += 1;
            return;
        }
        tracing::warn!(error = %error, suppressed = self.suppressed, "{what}");
        self.last = Some(Instant::now());
        self.suppressed = 0;
    }
}

/// One listener's accepting: every connection it hands out holds a slot (refused ones are
/// closed and counted under the listener's name), and when accepting fails (typically out of
/// file descriptors) it backs off, 5 ms doubling to 1 s, logging once per 5 s, instead of
/// spinning.
pub struct Acceptor {
    listener: TcpListener,
    slots: Arc<Slots>,
    refusals: Refusals,
    /// `http` or `kv` (`listener` of `kvgate_connections_refused_total`).
    name: &'static str,
    log: RateLimitedLog,
    backoff: Duration,
}

impl Acceptor {
    pub fn new(listener: TcpListener, slots: Arc<Slots>, refusals: Refusals, name: &'static str) -> Self {
        Acceptor { listener, slots, refusals, name, log: RateLimitedLog::default(), backoff: Duration::from_millis(5) }
    }

    /// The next connection that gets a slot (with TCP_NODELAY: a streamed token or a frame
    /// goes out at once, not after the peer's delayed ACK).
    pub async fn accept(&mut self) -> (TcpStream, SocketAddr, Slot) {
        loop {
            let (stream, peer) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    self.log.warn(&format!("accepting a {} connection failed; backing off", self.name.to_uppercase()), &e);
                    tokio::time::sleep(self.backoff).await;
                    self.backoff = (self.backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            };
            self.backoff = Duration::from_millis(5);
            match take_slot(&self.slots, peer.ip()) {
                Ok(slot) => {
                    let _ = stream.set_nodelay(true);
                    return (stream, peer, slot);
                }
                Err(why) => self.refusals.count(self.name, why), // dropping the stream closes it
            }
        }
    }
}

/// Serves `app` on the connections `listener` accepts until `shutdown` resolves, then drains
/// those in flight.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    refusals: Refusals,
    ready: Arc<AtomicBool>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    kvgate_telemetry::give_back_freed_memory();
    let mut acceptor = Acceptor::new(listener, Slots::new(limits.max_connections, limits.per_client), refusals, "http");
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.idle);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer, slot) = tokio::select! {
            accepted = acceptor.accept() => accepted,
            _ = &mut shutdown => break,
        };
        let app = app.clone();
        let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
            req.extensions_mut().insert(ClientAddr(peer));
            app.clone().oneshot(req)
        });
        let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "HTTP connection ended");
            }
            drop(slot);
        });
    }
    ready.store(false, Ordering::SeqCst);
    drop(acceptor);
    graceful.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_refused_names_the_cap_it_hit() {
        let slots = Slots::new(2, 1);
        let (a, b, c): (IpAddr, IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap(), "10.0.0.3".parse().unwrap());
        let _a = take_slot(&slots, a).unwrap();
        assert_eq!(take_slot(&slots, a).unwrap_err(), Saturation::ClientLimit);
        let _b = take_slot(&slots, b).unwrap();
        assert_eq!(take_slot(&slots, c).unwrap_err(), Saturation::ConnectionLimit);
    }
}
