//! The workers' HTTP listeners: an accept loop of our own over axum's router, because every port
//! is reachable by whoever is on the pod network. A connection needs a place (a total cap and
//! one per client address, so one peer cannot take them all); at a full pool a newcomer that
//! sent its request takes an idle connection's place or waits for one (`places.rs`), so a burst
//! of a peer's calls is served, not refused; a connection that sends no request head within the
//! idle deadline (an idle keep-alive, a slow header) is closed; refusals are counted in
//! `kvgate_connections_refused_total`, not as failed requests; accepting backs off when it
//! fails (out of descriptors) instead of spinning.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus::{IntCounterVec, Registry};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;

pub mod places;

use crate::metrics::RoleRegistry;
use places::{Admitted, NoPlace};
pub use places::{Caps, Place, Places};

/// The client's address, as a request extension (per-client limits read it).
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub SocketAddr);

/// Connection limits of one listener.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Connections open at once; more are closed as soon as they are accepted.
    pub max_connections: usize,
    /// Connections one client address may hold (beyond it, a newcomer takes an idle one's place
    /// or waits for one).
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
    /// An idle connection (no request in flight; on the KV port, not yet authenticated) was
    /// closed to make room for a newcomer of its address that had sent something (`places.rs`).
    Evicted,
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
            "Connections a listener closed unserved: over its cap, over one client's share, or (KV port) silent past the authentication deadline or evicted, idle, for a newcomer.",
            ["listener", "reason"],
            &LISTENERS,
            &reasons,
        ))
    }

    pub fn count(&self, listener: &str, why: Saturation) {
        self.0.with_label_values(&[listener, why.into()]).inc();
    }
}

/// A place for a newcomer on `listener` (`http` or `kv`), or none: then it is counted under
/// the cap that refused it, and closed when dropped. Taking an idle connection's place is
/// counted as `evicted`.
pub async fn admit(
    places: &Arc<Places>,
    refusals: &Refusals,
    listener: &'static str,
    stream: &TcpStream,
    peer: SocketAddr,
    deadline: tokio::time::Instant,
) -> Option<Place> {
    // A byte to read (or the peer's close), verified: `readable()` alone may wake spuriously.
    let spoke = async {
        let _ = stream.peek(&mut [0u8; 1]).await;
    };
    match places.admit(peer.ip(), spoke, deadline).await {
        Ok((place, how)) => {
            if how == Admitted::Evicted {
                refusals.count(listener, Saturation::Evicted);
            }
            Some(place)
        }
        Err(why) => {
            let why = match why {
                NoPlace::Client => Saturation::ClientLimit,
                NoPlace::Total => Saturation::ConnectionLimit,
            };
            refusals.count(listener, why);
            tracing::debug!(%peer, listener, reason = <&str>::from(why), "connection closed unserved: no place for it");
            None
        }
    }
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

/// One listener's accepting: when accepting fails (typically out of file descriptors) it backs
/// off, 5 ms doubling to 1 s, logging once per 5 s, instead of spinning. What a connection
/// needs to be served (a slot of the HTTP listener, a stranger's place on the KV port) is the
/// caller's to take.
pub struct Acceptor {
    listener: TcpListener,
    /// `http` or `kv` (`listener` of `kvgate_connections_refused_total`).
    name: &'static str,
    log: RateLimitedLog,
    backoff: Duration,
}

impl Acceptor {
    pub fn new(listener: TcpListener, name: &'static str) -> Self {
        Acceptor { listener, name, log: RateLimitedLog::default(), backoff: Duration::from_millis(5) }
    }

    /// The next connection (with TCP_NODELAY: a streamed token or a frame goes out at once,
    /// not after the peer's delayed ACK).
    pub async fn accept(&mut self) -> (TcpStream, SocketAddr) {
        loop {
            match self.listener.accept().await {
                Ok((stream, peer)) => {
                    self.backoff = Duration::from_millis(5);
                    let _ = stream.set_nodelay(true);
                    return (stream, peer);
                }
                Err(e) => {
                    self.log.warn(&format!("accepting a {} connection failed; backing off", self.name.to_uppercase()), &e);
                    tokio::time::sleep(self.backoff).await;
                    self.backoff = (self.backoff * 2).min(Duration::from_secs(1));
                }
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
    kvgate_heap::give_back_freed_memory();
    // As many newcomers may wait for a place as the listener serves connections.
    let places = Places::new(Caps { total: limits.max_connections, per_client: limits.per_client, waiting: limits.max_connections });
    let mut acceptor = Acceptor::new(listener, "http");
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.idle);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = acceptor.accept() => accepted,
            _ = &mut shutdown => break,
        };
        let (app, places, refusals, http, watcher) = (app.clone(), places.clone(), refusals.clone(), http.clone(), graceful.watcher());
        tokio::spawn(async move {
            let Some(place) = admit(&places, &refusals, "http", &stream, peer, tokio::time::Instant::now() + limits.idle).await else { return };
            let activity = place.activity().clone();
            let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
                // Busy from the request head until its response body is sent: a connection is
                // idle (and may give its place up) only between requests.
                let busy = activity.busy();
                req.extensions_mut().insert(ClientAddr(peer));
                let answer = app.clone().oneshot(req);
                async move {
                    let response = answer.await?;
                    Ok::<_, std::convert::Infallible>(response.map(|body| {
                        Body::new(body.map_err(move |e| {
                            let _ = &busy;
                            e
                        }))
                    }))
                }
            });
            let conn = watcher.watch(http.serve_connection(TokioIo::new(stream), service));
            tokio::select! {
                served = conn => if let Err(e) = served {
                    tracing::debug!(%peer, error = %e, "HTTP connection ended");
                },
                _ = place.evicted() => tracing::debug!(%peer, "idle HTTP connection closed for a newcomer from its address"),
            }
        });
    }
    ready.store(false, Ordering::SeqCst);
    drop(acceptor);
    graceful.shutdown().await;
    Ok(())
}
