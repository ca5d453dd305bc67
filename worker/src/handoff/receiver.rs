//! Decode's KV port: reads length-prefixed frames from prefill peers, checks each frame's MAC,
//! hands it to the reservation table, and answers the commit with an ack.
//!
//! The port is reachable by anyone on the network, so it is built to survive abuse: a cap on
//! connections, a deadline on every frame, bodies bounded before allocation, back-off (and
//! rate-limited logs) when accepting fails, and every refusal of bytes nobody holding the secret
//! sent counted in `kvgate_kv_port_rejected_total`, apart from integrity mismatches.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_proto::handoff::{AckFrame, Frame, FrameError, HEADER_LEN, HandoffId, parse_header};
use kvgate_proto::refusal::{PortRefusal, Refusal};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use super::reservations::{Reservations, Verdict};

/// Room for a page frame's fixed fields on top of the page itself.
const PAGE_FRAME_OVERHEAD: usize = 256;

/// Limits of the KV port.
#[derive(Debug, Clone, Copy)]
pub struct PortLimits {
    /// Connections served at once; more are closed as soon as they are accepted.
    pub max_connections: usize,
    /// Longest a single frame (header and body) may take to arrive, and longest a connection
    /// may sit idle between frames.
    pub frame_timeout: Duration,
}

/// Logs at most one line per interval, saying how many were held back.
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

pub async fn serve(listener: TcpListener, table: Arc<Reservations>, limits: PortLimits) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut log = RateLimitedLog { last: None, suppressed: 0 };
    let mut backoff = Duration::from_millis(5);
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                backoff = Duration::from_millis(5);
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    table.metrics.kv_port_rejected.with_label_values(&[PortRefusal::ConnectionLimit.as_str()]).inc();
                    drop(stream);
                    continue;
                };
                let table = table.clone();
                tokio::spawn(async move {
                    if let Err(e) = connection(stream, &table, limits.frame_timeout).await {
                        tracing::debug!(%peer, error = %e, "KV connection ended");
                    }
                    drop(slot);
                });
            }
            Err(e) => {
                // Typically out of file descriptors: retrying at once would spin.
                log.warn("accepting a KV connection failed; backing off", &e);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// One frame off the wire: its header and body bytes, or why there is none.
enum Read {
    Frame([u8; HEADER_LEN], Vec<u8>),
    /// The peer closed or broke the connection.
    Closed(std::io::Error),
    /// A protocol refusal (`kvgate_kv_port_rejected_total` reason and message).
    Refused(PortRefusal, String),
}

async fn read_frame(stream: &mut TcpStream, max_body: usize, timeout: Duration) -> Read {
    let read = async {
        let mut header = [0u8; HEADER_LEN];
        if let Err(e) = stream.read_exact(&mut header).await {
            return Read::Closed(e);
        }
        let h = match parse_header(&header) {
            Ok(h) => h,
            Err(e @ FrameError::TooLarge(_)) => return Read::Refused(PortRefusal::TooLarge, format!("kv_port_too_large: {e}")),
            Err(e) => return Read::Refused(PortRefusal::Malformed, format!("kv_port_malformed: {e}")),
        };
        if h.body_len as usize > max_body {
            return Read::Refused(PortRefusal::TooLarge, format!("kv_port_too_large: frame body of {} bytes exceeds {max_body}", h.body_len));
        }
        let mut body = vec![0u8; h.body_len as usize];
        match stream.read_exact(&mut body).await {
            Ok(_) => Read::Frame(header, body),
            Err(e) => Read::Closed(e),
        }
    };
    tokio::time::timeout(timeout, read)
        .await
        .unwrap_or_else(|_| Read::Refused(PortRefusal::ReadTimeout, format!("kv_port_read_timeout: no whole frame within {} ms", timeout.as_millis())))
}

async fn connection(mut stream: TcpStream, table: &Reservations, timeout: Duration) -> std::io::Result<()> {
    let _ = stream.set_nodelay(true);
    let max_body = table.page_bytes() + PAGE_FRAME_OVERHEAD;
    // The handoff this connection carries, once an authenticated frame named one.
    let mut bound: Option<HandoffId> = None;
    loop {
        let refused = |reason: PortRefusal, message: String| {
            table.metrics.kv_port_rejected.with_label_values(&[reason.as_str()]).inc();
            if let Some(id) = bound {
                table.connection_lost(id);
            }
            Verdict::new(reason, message)
        };
        let result = match read_frame(&mut stream, max_body, timeout).await {
            Read::Closed(e) => {
                if let Some(id) = bound {
                    table.connection_lost(id);
                }
                return Err(e);
            }
            Read::Refused(reason, message) => Err(refused(reason, message)),
            Read::Frame(header, body) => match Frame::decode_body(header[6], &body) {
                Err(e) => Err(refused(PortRefusal::Malformed, format!("kv_port_malformed: {e}"))),
                Ok(Frame::Ack(_)) => Err(refused(PortRefusal::Malformed, "kv_port_malformed: decode does not accept acks".into())),
                Ok(frame) => {
                    let id = frame.handoff().expect("pages and commits name a handoff");
                    let authentic = table.authenticate(&frame, &header, &body);
                    let accepted = match &frame {
                        Frame::Page(p) => table.accept_page(p, authentic).map(|_| false),
                        Frame::Commit(c) => table.accept_commit(c, authentic).map(|_| true),
                        Frame::Ack(_) => unreachable!("matched above"),
                    };
                    if authentic {
                        bound = Some(id);
                    }
                    accepted
                }
            },
        };
        match result {
            Ok(false) => continue,
            Ok(true) => {
                ack(&mut stream, AckFrame { ok: true, reason: String::new(), message: String::new() }).await?;
                return Ok(());
            }
            Err(v) => {
                if let Refusal::Port(_) = v.reason {
                    tracing::debug!(reason = %v.reason, message = %v.message, "KV port refused bytes nobody with the secret sent");
                } else {
                    tracing::warn!(reason = %v.reason, message = %v.message, "KV handoff refused");
                }
                ack(&mut stream, AckFrame { ok: false, reason: v.reason.as_str().into(), message: v.message }).await?;
                return Ok(());
            }
        }
    }
}

async fn ack(stream: &mut TcpStream, a: AckFrame) -> std::io::Result<()> {
    stream.write_all(&Frame::Ack(a).encode()).await?;
    stream.shutdown().await
}
