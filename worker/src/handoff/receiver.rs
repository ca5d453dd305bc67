//! Decode's KV port: reads length-prefixed frames from prefill peers, checks each frame's MAC
//! (a page's before its payload is read) and each page's tag over its payload, hands them to the
//! reservation table, and answers the commit with an ack.
//!
//! The port is reachable by anyone on the network, so it is built to survive abuse. A new
//! connection is a stranger's until it delivers an authentic frame: strangers share a small
//! pool of places, a few per client address, and must authenticate within a short deadline; a
//! newcomer at a full pool that has sent its frame takes the place of a stranger idle past a
//! grace or waits for one (`listener/places.rs`), so neither a burst of a peer's own connections
//! nor idle sockets at the peer's address keep a prefill peer that holds the secret out
//! (refusals and evictions counted in `kvgate_connections_refused_total{listener="kv"}`). Then: a cap on
//! authenticated connections, a deadline on every frame, bodies bounded before allocation,
//! back-off (and rate-limited logs) when accepting fails, and every refusal of bytes nobody
//! holding the secret sent counted in `kvgate_kv_port_rejected_total`, apart from integrity
//! mismatches.

use std::sync::Arc;
use std::time::Duration;

use kvgate_proto::auth::FrameKey;
use kvgate_proto::handoff::{
    AckFrame, Frame, FrameError, HEADER_LEN, HandoffId, KIND_PAGE, Mac, PAGE_FIELDS_LEN, PAGE_SEAL_LEN, PageFields, TAG_LEN, TenantTag, page_mac, parse_header,
};
use kvgate_proto::refusal::{PortRefusal, Refusal};
use kvgate_telemetry::trace_context::mark_failed;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use super::reservations::{HandoffRefusal, PageClaim, Reservations};
use crate::listener::{self, Acceptor, Caps, Place, Places, Refusals, Saturation};

/// Room for a page frame's fixed fields on top of the page itself.
const PAGE_FRAME_OVERHEAD: usize = 256;

/// Limits of the KV port.
#[derive(Debug, Clone, Copy)]
pub struct PortLimits {
    /// Authenticated connections served at once; more are refused.
    pub max_connections: usize,
    /// Connections that have not yet sent an authentic frame, in all and per client address;
    /// a newcomer beyond them takes an idle one's place or waits for one (`listener/places.rs`).
    pub max_unauthenticated: usize,
    pub max_unauthenticated_per_client: usize,
    /// Longest a new connection may take to deliver its first authentic frame.
    pub auth_timeout: Duration,
    /// Longest a single frame (header and body) may take to arrive, and longest a connection
    /// may sit idle between frames.
    pub frame_timeout: Duration,
}

/// What a connection holds: a stranger's place until it authenticates, then one of the port's.
struct Admission {
    stranger: Option<Place>,
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
    // As many newcomers may wait for a stranger's place as authenticated connections are
    // served: a burst of a peer's handoffs is never larger than what decode would serve.
    let caps = Caps { total: limits.max_unauthenticated, per_client: limits.max_unauthenticated_per_client, waiting: limits.max_connections };
    let strangers = Places::new(caps);
    let mut acceptor = Acceptor::new(listener, "kv");
    loop {
        let (stream, peer) = acceptor.accept().await;
        let (table, strangers, authenticated, refusals) = (table.clone(), strangers.clone(), authenticated.clone(), refusals.clone());
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + limits.auth_timeout;
            let Some(place) = listener::admit(&strangers, &refusals, "kv", &stream, peer, deadline).await else { return };
            let admission = Admission { stranger: Some(place), authenticated, held: None, refusals };
            if let Err(e) = connection(stream, &table, limits, admission).await {
                tracing::debug!(%peer, error = %e, "KV connection ended");
            }
        });
    }
}

/// One frame off the wire, or why there is none.
enum Read {
    /// A page frame up to its payload, which is still on the wire.
    Page(Box<PageHead>),
    /// Any other frame: its header and body bytes.
    Frame([u8; HEADER_LEN], Vec<u8>),
    /// The peer closed or broke the connection.
    Closed(std::io::Error),
    /// A protocol refusal (`kvgate_kv_port_rejected_total` reason and message).
    Refused(PortRefusal, String),
}

/// A page frame's header, fields, tag and MAC, read before its payload.
struct PageHead {
    fields: PageFields,
    tag: u128,
    /// The handoff's key (`None` with integrity checks off).
    key: Option<FrameKey>,
    /// Whether its MAC (over header, fields and tag) verified; true with integrity checks off.
    authentic: bool,
    /// Time spent checking the MAC.
    hashing: Duration,
    /// When the whole frame, payload included, must have arrived.
    deadline: tokio::time::Instant,
}

/// The connection's read buffer: small frames (a small model's pages, commits) come out of it,
/// not one read call each; a large page's payload mostly bypasses it, straight into the page.
const BUFFER: usize = 256 << 10;

/// Reads one frame; a page frame only up to its payload, so its MAC is checked before a byte of
/// the payload is taken in.
async fn read_frame(stream: &mut BufReader<TcpStream>, table: &Reservations, keys: &mut KeyCache, max_body: usize, timeout: Duration) -> Read {
    let deadline = tokio::time::Instant::now() + timeout;
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
            return read_page_head(stream, &header, h.body_len as usize, table, keys, deadline).await;
        }
        let mut body = vec![0u8; h.body_len as usize];
        match stream.read_exact(&mut body).await {
            Ok(_) => Read::Frame(header, body),
            Err(e) => Read::Closed(e),
        }
    };
    tokio::time::timeout_at(deadline, read).await.unwrap_or_else(|_| {
        let (reason, message) = read_timeout(timeout);
        Read::Refused(reason, message)
    })
}

/// The refusal of a frame that did not arrive whole within `timeout`.
fn read_timeout(timeout: Duration) -> (PortRefusal, String) {
    (PortRefusal::ReadTimeout, format!("kv_port_read_timeout: no whole frame within {} ms", timeout.as_millis()))
}

/// The last handoff's key a connection derived (for the tenant its frames name): a connection
/// carries one handoff, so its key (three BLAKE3 calls and the tag's powers) is derived once,
/// not once per page.
type KeyCache = Option<(HandoffId, TenantTag, Option<FrameKey>)>;

async fn read_page_head(
    stream: &mut BufReader<TcpStream>,
    header: &[u8; HEADER_LEN],
    body_len: usize,
    table: &Reservations,
    keys: &mut KeyCache,
    deadline: tokio::time::Instant,
) -> Read {
    // Header and fields together, as the MAC covers them.
    let mut head = [0u8; HEADER_LEN + PAGE_FIELDS_LEN];
    head[..HEADER_LEN].copy_from_slice(header);
    if body_len < PAGE_FIELDS_LEN + PAGE_SEAL_LEN {
        return Read::Refused(PortRefusal::Malformed, format!("kv_port_malformed: a page frame body of {body_len} bytes is shorter than its fixed fields"));
    }
    if let Err(e) = stream.read_exact(&mut head[HEADER_LEN..]).await {
        return Read::Closed(e);
    }
    let fields = PageFields::decode(head[HEADER_LEN..].try_into().expect("the fields"));
    let len = fields.payload_len as usize;
    if PAGE_FIELDS_LEN + PAGE_SEAL_LEN + len != body_len || len > table.page_bytes() {
        return Read::Refused(
            PortRefusal::Malformed,
            format!("kv_port_malformed: a page frame of {body_len} bytes declares a {len}-byte payload (a page is {} bytes)", table.page_bytes()),
        );
    }
    let mut seal = [0u8; PAGE_SEAL_LEN];
    if let Err(e) = stream.read_exact(&mut seal).await {
        return Read::Closed(e);
    }
    let tag = u128::from_le_bytes(seal[..TAG_LEN].try_into().expect("a tag"));
    let mac = Mac(seal[TAG_LEN..].try_into().expect("a MAC"));
    let started = std::time::Instant::now();
    let key = match keys {
        Some((id, tenant, key)) if *id == fields.handoff && *tenant == fields.tenant => key.clone(),
        _ => keys.insert((fields.handoff, fields.tenant, table.frame_key(fields.handoff, fields.tenant))).2.clone(),
    };
    let authentic = key.as_ref().is_none_or(|k| page_mac(k, &head, tag).verify(&mac));
    Read::Page(Box::new(PageHead { fields, tag, key, authentic, hashing: started.elapsed(), deadline }))
}

/// How reading a claimed page's payload ended.
enum Payload {
    /// All of it is in the page: its tag as received (0 with checks off) and the time spent on it.
    Read(u128, Duration),
    /// The pool would not take it (the handoff failed).
    Refused(HandoffRefusal),
    /// The peer closed or broke the connection.
    Lost(std::io::Error),
}

/// Reads a claimed page's payload straight from the socket into the page (what the read buffer
/// already holds is copied from it; a device pool's page is written through `staging`), each
/// piece fed to the page's tag as it lands, while it is still in cache.
async fn read_payload(stream: &mut BufReader<TcpStream>, table: &Reservations, claim: &PageClaim, head: &PageHead, staging: &mut Vec<u8>) -> Payload {
    let len = head.fields.payload_len as usize;
    let mut tag = head.key.as_ref().map(|k| k.page_tags().hasher());
    let mut hashing = Duration::ZERO;
    let mut feed = |bytes: &[u8]| {
        if let Some(tag) = &mut tag {
            let started = std::time::Instant::now();
            tag.update(bytes);
            hashing += started.elapsed();
        }
    };
    let held = stream.buffer().len().min(len);
    if let Err(v) = table.write_claimed(claim, 0, &stream.buffer()[..held]) {
        return Payload::Refused(v);
    }
    feed(&stream.buffer()[..held]);
    stream.consume(held);
    let mut at = held;
    while at < len {
        let socket = stream.get_ref();
        if let Err(e) = socket.readable().await {
            return Payload::Lost(e);
        }
        let filled = table.fill_claimed(claim, at, |page| match socket.try_read(&mut page[..len - at]) {
            Ok(0) => Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                feed(&page[..n]);
                Ok(n)
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(0),
            Err(e) => Err(e),
        });
        let n = match filled {
            Err(v) => return Payload::Refused(v),
            Ok(Some(Ok(n))) => n,
            Ok(Some(Err(e))) => return Payload::Lost(e),
            // Pages on a device: through the staging buffer.
            Ok(None) => {
                let n = (len - at).min(BUFFER);
                staging.resize(n, 0);
                if let Err(e) = stream.read_exact(staging).await {
                    return Payload::Lost(e);
                }
                feed(staging);
                if let Err(v) = table.write_claimed(claim, at, staging) {
                    return Payload::Refused(v);
                }
                n
            }
        };
        at += n;
    }
    Payload::Read(tag.map_or(0, |t| t.finish(head.fields.index)), hashing)
}

async fn connection(stream: TcpStream, table: &Reservations, limits: PortLimits, mut admission: Admission) -> std::io::Result<()> {
    let mut stream = BufReader::with_capacity(BUFFER, stream);
    let max_body = table.page_bytes() + PAGE_FRAME_OVERHEAD;
    // Where a device pool's pages are staged (empty for a host pool).
    let mut staging = Vec::new();
    let mut keys: KeyCache = None;
    // The handoff this connection carries, once an authenticated frame named one.
    let mut bound: Option<HandoffId> = None;
    // Its span, under the request's trace, once a frame named a handoff decode reserved.
    let mut receipt = Receipt::default();
    loop {
        // Takes the bound handoff as it is when the refusal is made.
        let refused = |bound: Option<HandoffId>, reason: PortRefusal, message: String| {
            table.metrics.kv_port_rejected.with_label_values(&[reason.as_str()]).inc();
            if let Some(id) = bound {
                table.connection_lost(id);
            }
            HandoffRefusal::new(reason, message)
        };
        // A stranger has a short deadline to prove it holds the secret.
        let timeout = if bound.is_none() { limits.auth_timeout.min(limits.frame_timeout) } else { limits.frame_timeout };
        let read = match &admission.stranger {
            // An idle stranger gives its place up to a newcomer (`listener/places.rs`); a frame
            // that has arrived is read first.
            Some(place) => tokio::select! {
                biased;
                read = read_frame(&mut stream, table, &mut keys, max_body, timeout) => read,
                _ = place.evicted() => return Ok(()),
            },
            None => read_frame(&mut stream, table, &mut keys, max_body, timeout).await,
        };
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
            Read::Refused(reason, message) => Err(refused(bound, reason, message)),
            Read::Page(head) => {
                let id = head.fields.handoff;
                receipt.page(table, id, head.fields.payload_len as usize, head.hashing);
                if head.authentic && !admission.promote() {
                    Err(refused(
                        bound,
                        PortRefusal::ConnectionLimit,
                        format!("kv_port_connection_limit: {} authenticated connections already", limits.max_connections),
                    ))
                } else {
                    if head.authentic {
                        bound = Some(id);
                    }
                    // An unauthentic frame is refused here, before its payload is read.
                    match table.claim_page(&head.fields, head.tag, head.authentic) {
                        Err(v) => Err(v),
                        Ok(claim) => match tokio::time::timeout_at(head.deadline, read_payload(&mut stream, table, &claim, &head, &mut staging)).await {
                            Err(_) => {
                                let (reason, message) = read_timeout(timeout);
                                Err(refused(bound, reason, message))
                            }
                            Ok(Payload::Lost(e)) => {
                                table.connection_lost(id);
                                return Err(e);
                            }
                            Ok(Payload::Refused(v)) => Err(v),
                            Ok(Payload::Read(tag, hashing)) => {
                                receipt.hashing += hashing;
                                table.complete_page(claim, tag).map(|_| false)
                            }
                        },
                    }
                }
            }
            Read::Frame(header, body) => match Frame::decode_body(header[6], &body) {
                Err(e) => Err(refused(bound, PortRefusal::Malformed, format!("kv_port_malformed: {e}"))),
                // Pages never get here: read_frame hands them to read_page_head.
                Ok(ref frame @ Frame::Commit(ref c)) => {
                    receipt.open(table, c.handoff);
                    let _verifying = receipt.span.as_ref().map(|s| tracing::info_span!(parent: s, "commit_verify").entered());
                    let authentic = table.authenticate(frame, &header, &body);
                    if authentic && !admission.promote() {
                        Err(refused(
                            bound,
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
                Ok(_) => Err(refused(bound, PortRefusal::Malformed, "kv_port_malformed: decode does not accept acks".into())),
            },
        };
        let stream = stream.get_mut();
        match result {
            Ok(false) => continue,
            Ok(true) => {
                receipt.close(None);
                ack(stream, AckFrame::accepted()).await?;
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
                ack(stream, AckFrame::refused(v.reason, v.message)).await?;
                return Ok(());
            }
        }
    }
}

/// The span of one handoff's receipt: pages and bytes received, time in the MAC and page tag,
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
        let Some(origin) = table.origin_of(id) else { return };
        let span = tracing::info_span!(
            "handoff_receive",
            trace_id = tracing::field::Empty,
            span_id = tracing::field::Empty,
            handoff_id = %id,
            tenant = %origin.tenant,
            pages = tracing::field::Empty,
            bytes = tracing::field::Empty,
            integrity_seconds = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            otel.status_description = tracing::field::Empty,
            error.type = tracing::field::Empty,
            // A searchable mark (span status is not an attribute a trace search can match).
            refused = tracing::field::Empty,
        );
        kvgate_telemetry::trace_context::adopt(&span, Some(origin.trace));
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
