//! Decode's KV port: reads length-prefixed frames from prefill peers, checks each frame's MAC,
//! hands it to the reservation table, and answers the commit with an ack.
//!
//! The port is reachable by anyone on the network, so it is built to survive abuse. A new
//! connection is a stranger's until it delivers an authentic frame: strangers share a small
//! pool of slots, a few per client address, and must authenticate within a short deadline, so
//! idle sockets from elsewhere never take the slots of prefill peers that hold the secret
//! (refusals counted in `kvgate_connections_refused_total{listener="kv"}`). Then: a cap on
//! authenticated connections, a deadline on every frame, bodies bounded before allocation,
//! back-off (and rate-limited logs) when accepting fails, and every refusal of bytes nobody
//! holding the secret sent counted in `kvgate_kv_port_rejected_total`, apart from integrity
//! mismatches.

use std::sync::Arc;
use std::time::Duration;

use kvgate_proto::handoff::{
    AckFrame, Frame, FrameError, HEADER_LEN, HandoffId, KIND_PAGE, Mac, PAGE_FIELDS_LEN, PAGE_TRAILER_LEN, PageFields, PageView, parse_header,
};
use kvgate_proto::refusal::{PortRefusal, Refusal};
use kvgate_telemetry::trace_context::mark_failed;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use xxhash_rust::xxh3::Xxh3;

use super::reservations::{Reservations, Verdict};
use crate::server::listener::{Acceptor, Refusals, Saturation, Slot, Slots};

/// Room for a page frame's fixed fields on top of the page itself.
const PAGE_FRAME_OVERHEAD: usize = 256;

/// Limits of the KV port.
#[derive(Debug, Clone, Copy)]
pub struct PortLimits {
    /// Authenticated connections served at once; more are refused.
    pub max_connections: usize,
    /// Connections that have not yet sent an authentic frame, in all and per client address;
    /// more are closed as soon as they are accepted.
    pub max_unauthenticated: usize,
    pub max_unauthenticated_per_client: usize,
    /// Longest a new connection may take to deliver its first authentic frame.
    pub auth_timeout: Duration,
    /// Longest a single frame (header and body) may take to arrive, and longest a connection
    /// may sit idle between frames.
    pub frame_timeout: Duration,
}

/// What a connection holds: a stranger's slot until it authenticates, then one of the port's.
struct Admission {
    stranger: Option<Slot>,
    authenticated: Arc<Semaphore>,
    held: Option<tokio::sync::OwnedSemaphorePermit>,
    refusals: Refusals,
}

impl Admission {
    /// Moves the connection from the strangers' pool to the authenticated one; false when that
    /// is full.
    fn promote(&mut self) -> bool {
        if self.held.is_some() {
            return true;
        }
        self.stranger = None;
        self.held = self.authenticated.clone().try_acquire_owned().ok();
        self.held.is_some()
    }
}

pub async fn serve(listener: TcpListener, table: Arc<Reservations>, limits: PortLimits, refusals: Refusals) {
    let authenticated = Arc::new(Semaphore::new(limits.max_connections));
    let strangers = Slots::new(limits.max_unauthenticated, limits.max_unauthenticated_per_client);
    let mut acceptor = Acceptor::new(listener, strangers, refusals.clone(), "kv");
    loop {
        let (stream, peer, slot) = acceptor.accept().await;
        let admission = Admission { stranger: Some(slot), authenticated: authenticated.clone(), held: None, refusals: refusals.clone() };
        let table = table.clone();
        tokio::spawn(async move {
            if let Err(e) = connection(stream, &table, limits, admission).await {
                tracing::debug!(%peer, error = %e, "KV connection ended");
            }
        });
    }
}

/// One frame off the wire, or why there is none.
enum Read {
    /// A page frame; its payload is in the connection's page buffer.
    Page(ReceivedPage),
    /// Any other frame: its header and body bytes.
    Frame([u8; HEADER_LEN], Vec<u8>),
    /// The peer closed or broke the connection.
    Closed(std::io::Error),
    /// A protocol refusal (`kvgate_kv_port_rejected_total` reason and message).
    Refused(PortRefusal, String),
}

/// A page frame as it arrived, with what was computed over it on the way in.
struct ReceivedPage {
    fields: PageFields,
    checksum: u64,
    mac: Mac,
    /// The MAC of the bytes received (`None` with integrity checks off).
    computed_mac: Option<Mac>,
    /// xxh3-64 of the payload received (0 with integrity checks off).
    payload_xxh3: u64,
    /// Time spent computing the MAC and the checksum over it.
    hashing: Duration,
}

/// How much of a page is read before it is hashed: small enough to be hashed while the bytes
/// are still in cache.
const CHUNK: usize = 256 << 10;

/// Reads one frame. A page's payload lands in `page` chunk by chunk, each chunk hashed (MAC and
/// checksum) as soon as it arrives, so no second pass over the page is needed.
async fn read_frame(stream: &mut BufReader<TcpStream>, page: &mut [u8], table: &Reservations, max_body: usize, timeout: Duration) -> Read {
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
        if h.kind == KIND_PAGE {
            return read_page(stream, &header, h.body_len as usize, page, table).await;
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

async fn read_page(stream: &mut BufReader<TcpStream>, header: &[u8; HEADER_LEN], body_len: usize, page: &mut [u8], table: &Reservations) -> Read {
    let mut fields_bytes = [0u8; PAGE_FIELDS_LEN];
    if body_len < PAGE_FIELDS_LEN + PAGE_TRAILER_LEN {
        return Read::Refused(PortRefusal::Malformed, format!("kv_port_malformed: a page frame body of {body_len} bytes is shorter than its fixed fields"));
    }
    if let Err(e) = stream.read_exact(&mut fields_bytes).await {
        return Read::Closed(e);
    }
    let fields = PageFields::decode(&fields_bytes);
    let len = fields.payload_len as usize;
    if PAGE_FIELDS_LEN + len + PAGE_TRAILER_LEN != body_len || len > page.len() {
        return Read::Refused(
            PortRefusal::Malformed,
            format!("kv_port_malformed: a page frame of {body_len} bytes declares a {len}-byte payload (a page is {} bytes)", page.len()),
        );
    }
    // The MAC and the payload's checksum, both fed as the bytes arrive (none with checks off).
    let mut hashes = table.page_mac(fields.handoff).map(|mut mac| {
        mac.update(header);
        mac.update(&fields_bytes);
        (mac, Xxh3::new())
    });
    let mut hashing = Duration::ZERO;
    for chunk in page[..len].chunks_mut(CHUNK) {
        if let Err(e) = stream.read_exact(chunk).await {
            return Read::Closed(e);
        }
        if let Some((mac, sum)) = &mut hashes {
            let started = std::time::Instant::now();
            mac.update(chunk);
            sum.update(chunk);
            hashing += started.elapsed();
        }
    }
    let mut trailer = [0u8; PAGE_TRAILER_LEN];
    if let Err(e) = stream.read_exact(&mut trailer).await {
        return Read::Closed(e);
    }
    let (checksum, tag) = trailer.split_at(8);
    if let Some((mac, _)) = &mut hashes {
        mac.update(checksum);
    }
    Read::Page(ReceivedPage {
        fields,
        checksum: u64::from_le_bytes(checksum.try_into().expect("8 bytes")),
        mac: Mac(tag.try_into().expect("a MAC")),
        computed_mac: hashes.as_ref().map(|(mac, _)| mac.finish()),
        payload_xxh3: hashes.map_or(0, |(_, sum)| sum.digest()),
        hashing,
    })
}

async fn connection(stream: TcpStream, table: &Reservations, limits: PortLimits, mut admission: Admission) -> std::io::Result<()> {
    // Small frames (a small model's pages, commits) are read out of one buffer, not one read
    // call each; a page's payload bypasses it once the buffer is drained.
    let mut stream = BufReader::with_capacity(CHUNK, stream);
    let max_body = table.page_bytes() + PAGE_FRAME_OVERHEAD;
    // One page's payload, reused by every page frame of the connection.
    let mut page = vec![0u8; table.page_bytes()];
    // The handoff this connection carries, once an authenticated frame named one.
    let mut bound: Option<HandoffId> = None;
    // Its span, under the request's trace, once a frame named a handoff decode reserved.
    let mut receipt = Receipt::default();
    loop {
        let refused = |reason: PortRefusal, message: String| {
            table.metrics.kv_port_rejected.with_label_values(&[reason.as_str()]).inc();
            if let Some(id) = bound {
                table.connection_lost(id);
            }
            Verdict::new(reason, message)
        };
        // A stranger has a short deadline to prove it holds the secret.
        let timeout = if bound.is_none() { limits.auth_timeout.min(limits.frame_timeout) } else { limits.frame_timeout };
        let read = read_frame(&mut stream, &mut page, table, max_body, timeout).await;
        if bound.is_none() && matches!(read, Read::Refused(PortRefusal::ReadTimeout, _)) {
            admission.refusals.count("kv", Saturation::Unauthenticated);
        }
        let result = match read {
            Read::Closed(e) => {
                if let Some(id) = bound {
                    table.connection_lost(id);
                }
                return Err(e);
            }
            Read::Refused(reason, message) => Err(refused(reason, message)),
            Read::Page(p) => {
                receipt.page(table, p.fields.handoff, p.fields.payload_len as usize, p.hashing);
                let view = PageView { fields: p.fields, checksum: p.checksum, payload: &page[..p.fields.payload_len as usize], mac: p.mac };
                let authentic = p.computed_mac.is_none_or(|m| m.verify(&p.mac));
                if authentic && !admission.promote() {
                    Err(refused(
                        PortRefusal::ConnectionLimit,
                        format!("kv_port_connection_limit: {} authenticated connections already", limits.max_connections),
                    ))
                } else {
                    let accepted = table.accept_page(&view, authentic, p.payload_xxh3);
                    if authentic {
                        bound = Some(p.fields.handoff);
                    }
                    accepted.map(|_| false)
                }
            }
            Read::Frame(header, body) => match Frame::decode_body(header[6], &body) {
                Err(e) => Err(refused(PortRefusal::Malformed, format!("kv_port_malformed: {e}"))),
                // Pages never get here: read_frame hands them to read_page.
                Ok(ref frame @ Frame::Commit(ref c)) => {
                    receipt.open(table, c.handoff);
                    let _verifying = receipt.span.as_ref().map(|s| tracing::info_span!(parent: s, "commit_verify").entered());
                    let authentic = table.authenticate(frame, &header, &body);
                    if authentic && !admission.promote() {
                        Err(refused(
                            PortRefusal::ConnectionLimit,
                            format!("kv_port_connection_limit: {} authenticated connections already", limits.max_connections),
                        ))
                    } else {
                        let accepted = table.accept_commit(c, authentic).map(|_| true);
                        if authentic {
                            bound = Some(c.handoff);
                        }
                        accepted
                    }
                }
                Ok(_) => Err(refused(PortRefusal::Malformed, "kv_port_malformed: decode does not accept acks".into())),
            },
        };
        let stream = stream.get_mut();
        match result {
            Ok(false) => continue,
            Ok(true) => {
                receipt.close(None);
                ack(stream, AckFrame { ok: true, reason: String::new(), message: String::new() }).await?;
                return Ok(());
            }
            Err(v) => {
                let span = receipt.span.clone().unwrap_or_else(tracing::Span::none);
                span.in_scope(|| {
                    if let Refusal::Port(_) = v.reason {
                        tracing::debug!(reason = %v.reason, detail = %v.message, "KV port refused bytes nobody with the secret sent");
                    } else {
                        tracing::warn!(reason = %v.reason, detail = %v.message, "KV handoff refused");
                    }
                });
                receipt.close(Some(v.reason.as_str()));
                ack(stream, AckFrame { ok: false, reason: v.reason.as_str().into(), message: v.message }).await?;
                return Ok(());
            }
        }
    }
}

/// The span of one handoff's receipt: pages and bytes received, time in the MAC and checksum,
/// and, when refused, the reason as its error. Opened by the first frame that names a handoff
/// decode reserved (so strangers' frames for made-up ids open none).
#[derive(Default)]
struct Receipt {
    span: Option<tracing::Span>,
    pages: usize,
    bytes: usize,
    hashing: Duration,
}

impl Receipt {
    fn open(&mut self, table: &Reservations, id: HandoffId) {
        if self.span.is_some() {
            return;
        }
        let Some(trace) = table.trace_of(id) else { return };
        let span = tracing::info_span!(
            "handoff_receive",
            trace_id = tracing::field::Empty,
            span_id = tracing::field::Empty,
            handoff_id = %id,
            pages = tracing::field::Empty,
            bytes = tracing::field::Empty,
            integrity_seconds = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            otel.status_description = tracing::field::Empty,
            error.type = tracing::field::Empty,
            // A searchable mark (span status is not an attribute a trace search can match).
            refused = tracing::field::Empty,
        );
        kvgate_telemetry::trace_context::adopt(&span, Some(trace));
        self.span = Some(span);
    }

    fn page(&mut self, table: &Reservations, id: HandoffId, bytes: usize, hashing: Duration) {
        self.open(table, id);
        self.pages += 1;
        self.bytes += bytes;
        self.hashing += hashing;
    }

    /// Records the totals; `refused` names the reason the handoff was refused.
    fn close(&mut self, refused: Option<&str>) {
        let Some(span) = self.span.take() else { return };
        span.record("pages", self.pages as i64);
        span.record("bytes", self.bytes as i64);
        span.record("integrity_seconds", self.hashing.as_secs_f64());
        if let Some(reason) = refused {
            mark_failed(&span, reason);
            span.record("refused", true);
        }
    }
}

async fn ack(stream: &mut TcpStream, a: AckFrame) -> std::io::Result<()> {
    stream.write_all(&Frame::Ack(a).encode()).await?;
    stream.shutdown().await
}
