//! Prefill's side of the handoff: check that decode minted the reservation, stream the prompt's
//! pages into it (each MACed with the handoff's frame key, slots past the prompt zeroed), commit,
//! and report decode's ack. The frames go through a `Sink`: decode's KV port, or (in a test
//! build) a fault decorator around it.

use kvgate_proto::auth::{FrameKey, Mac};
use kvgate_proto::handoff::{
    AckFrame, CommitFrame, Frame, HEADER_LEN, HandoffId, MAC_LEN, PAGE_FIELDS_LEN, PAGE_SEAL_LEN, PageFields, TAG_LEN, TenantTag, digest, page_mac, page_seal,
    parse_header,
};
use kvgate_proto::logprobs::TokenLogprobs;
use kvgate_proto::roles::Reservation;
use std::io::IoSlice;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::TcpStream;

use super::auth::Secret;
use super::metrics::HandoffMetrics;
use super::reservations::fingerprint_u64;
use crate::kv::{KvError, KvPool, Lease};

/// How the transfer ended, from prefill's point of view.
#[derive(Debug)]
pub enum SendOutcome {
    /// Decode answered (accepted or refused).
    Acked(AckFrame),
    /// The connection was dropped half way (the die-mid-transfer fault).
    Died,
}

/// Why prefill sent nothing, or could not finish.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The reservation is not one this deployment's decode minted for this prompt: nothing is
    /// sent (prefill never dials an address it cannot trust).
    #[error("reservation refused: {0}")]
    Reservation(String),
    #[error("connecting to decode's KV port {addr}: {source}")]
    Connect { addr: String, source: std::io::Error },
    #[error("KV connection to decode: {0}")]
    Io(#[from] std::io::Error),
    #[error("reading a page of the prompt's KV: {0}")]
    Pool(#[from] KvError),
    #[error("decode's answer: {0}")]
    Ack(String),
    #[error("this worker's {0}")]
    Fingerprint(String),
}

pub struct Transfer<'a> {
    pub pool: &'a KvPool,
    pub lease: &'a Lease,
    /// The prompt tokens prefill computed (the lease's, for an honest prefill).
    pub prompt_tokens: usize,
    pub reservation: &'a Reservation,
    /// The tenant whose prompt the KV was computed for: every frame carries it and is sealed
    /// under its key.
    pub tenant: TenantTag,
    pub secret: &'a Secret,
    pub first_token: u32,
    /// Its log-probabilities, when the client asked for them (they travel in the commit).
    pub first_logprobs: Option<TokenLogprobs>,
    pub model_fingerprint: &'a str,
    pub layout_fingerprint: &'a str,
    pub metrics: &'a HandoffMetrics,
}

/// Checks a reservation before anything is computed or sent: decode's tag over every field
/// (so `kv_addr` is decode's own KV port), time left, the page count for the tokens, and the
/// layout. `prompt_tokens` is the prompt prefill was asked to compute.
pub fn check_reservation(r: &Reservation, secret: &Secret, prompt_tokens: usize, layout_fingerprint: &str, page_size: usize) -> Result<HandoffId, SendError> {
    let bad = |m: String| SendError::Reservation(m);
    let id = r.handoff_id;
    if !secret.key().reservation_tag(&r.fields()).verify(&r.tag) {
        return Err(bad(format!("reservation {id} does not carry a tag of this deployment's decode (forged or altered; kv_addr {})", r.kv_addr)));
    }
    if r.expires_ms <= kvgate_proto::auth::now_ms() {
        return Err(bad(format!("reservation {id} expired at {} ms", r.expires_ms)));
    }
    if r.reserved_tokens as usize != prompt_tokens {
        return Err(bad(format!("reservation {id} is for {} tokens, the prompt has {prompt_tokens}", r.reserved_tokens)));
    }
    if r.pages.len() != (r.reserved_tokens as usize).div_ceil(page_size) {
        return Err(bad(format!("reservation {id} lists {} pages for {} tokens of {page_size}-token pages", r.pages.len(), r.reserved_tokens)));
    }
    if r.layout_fingerprint != layout_fingerprint {
        return Err(bad(format!("reservation {id} is for KV layout {}, this worker's is {layout_fingerprint}", r.layout_fingerprint)));
    }
    Ok(id)
}

/// What the sender does with page `i` of `n` before reading it from the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Send,
    /// Send no more pages; commit now.
    Stop,
    /// Drop the connection where it is.
    Die,
}

/// Where sealed frames go: decode's KV port ([`KvConnection`]); under the `testing` feature a
/// fault decorator (`faulty::Faulty`) may wrap it, chosen at start-up, and bend one rule.
#[allow(async_fn_in_trait)] // used with concrete types only, never as a trait object
pub trait Sink {
    /// Before page `i` of `n` is read from the pool.
    fn flow(&mut self, _i: usize, _n: usize) -> Flow {
        Flow::Send
    }
    /// A sealed page frame, to send.
    async fn page(&mut self, frame: &mut OutgoingPage<'_>) -> Result<(), SendError>;
    /// The commit, to sign with `key` (none with the integrity checks off) and send.
    async fn commit(&mut self, commit: CommitFrame, key: Option<&FrameKey>) -> Result<(), SendError>;
    /// Decode's answer.
    async fn ack(self) -> Result<AckFrame, SendError>;
    /// Leaves the transfer where it is (what was written is flushed first).
    async fn abandon(self) -> Result<(), SendError>;
}

/// Pages at least this large go to the socket straight from the pool (read-locked for each
/// non-blocking write), not through a copy: at 2 MiB a page (an 8B-shaped layout) copying it out
/// cost more than tagging it. Smaller pages are staged, so that many leave in one write.
pub const IN_PLACE_MIN_BYTES: usize = 64 << 10;

/// Header, fields, tag and MAC: what precedes a page frame's payload on the wire.
const FRAME_HEAD_LEN: usize = HEADER_LEN + PAGE_FIELDS_LEN + PAGE_SEAL_LEN;

/// One page of the lease, where it lies in the pool.
#[derive(Clone, Copy)]
pub struct PoolPage<'a> {
    pool: &'a KvPool,
    lease: &'a Lease,
    index: usize,
}

impl PoolPage<'_> {
    /// `read` over the page's bytes, under its read lock.
    pub fn read<R>(&self, read: impl FnOnce(&[u8]) -> R) -> Result<R, KvError> {
        self.pool.read_page(self.lease, self.index, read)
    }
}

/// Where a page frame's payload is.
pub enum Payload<'f> {
    /// Copied out of the pool (slots past the prompt zeroed).
    Staged(&'f [u8]),
    /// Still in the pool: a full page, read when it is written.
    InPool(PoolPage<'f>),
}

/// One page frame: header, fields, tag and MAC, then the payload, staged in a buffer or still in
/// the pool.
pub struct OutgoingPage<'a> {
    pub fields: PageFields,
    head: [u8; FRAME_HEAD_LEN],
    page: PoolPage<'a>,
    /// The staging buffer (a page long), holding the payload when `staged`.
    buf: &'a mut [u8],
    staged: bool,
}

impl<'a> OutgoingPage<'a> {
    /// A full page's frame whose payload stays in the pool.
    fn in_pool(fields: PageFields, page: PoolPage<'a>, buf: &'a mut [u8]) -> Self {
        OutgoingPage { fields, head: [0; FRAME_HEAD_LEN], page, buf, staged: false }
    }

    /// A frame whose payload is copied into `buf`, with the slots past its `fields.tokens` zeroed:
    /// they were never written by this request, and whatever is there (another tenant's KV when
    /// scrubbing is off) stays here.
    fn staged(fields: PageFields, page: PoolPage<'a>, buf: &'a mut [u8]) -> Result<Self, SendError> {
        let mut frame = OutgoingPage { fields, head: [0; FRAME_HEAD_LEN], page, buf, staged: false };
        frame.stage()?;
        for range in page.pool.layout().unwritten_byte_ranges(fields.tokens as usize) {
            frame.buf[range].fill(0);
        }
        Ok(frame)
    }

    fn stage(&mut self) -> Result<(), SendError> {
        if !self.staged {
            self.page.pool.copy_page(self.page.lease, self.page.index, self.buf)?;
            self.staged = true;
        }
        Ok(())
    }

    /// Header, fields, tag and MAC.
    pub fn head(&self) -> &[u8] {
        &self.head
    }

    pub fn payload(&self) -> Payload<'_> {
        if self.staged { Payload::Staged(self.buf) } else { Payload::InPool(self.page) }
    }

    /// The payload, to alter (a fault does): a page still in the pool is staged first, so the
    /// pool is never written.
    pub fn payload_mut(&mut self) -> Result<&mut [u8], SendError> {
        self.stage()?;
        Ok(self.buf)
    }

    /// Bytes on the wire.
    pub fn wire_len(&self) -> usize {
        FRAME_HEAD_LEN + self.buf.len()
    }

    /// The tag the frame carries (its payload's MAC, `page_tag`).
    pub fn tag(&self) -> u128 {
        let at = HEADER_LEN + PAGE_FIELDS_LEN;
        u128::from_le_bytes(self.head[at..at + TAG_LEN].try_into().expect("16 bytes"))
    }

    /// Writes header and fields, the payload's tag (one pass over the payload) and the MAC over
    /// header, fields and tag (`None`: zeros, the integrity checks off).
    pub fn seal(&mut self, key: Option<&FrameKey>) -> Result<(), SendError> {
        let (head, seal) = self.head.split_at_mut(HEADER_LEN + PAGE_FIELDS_LEN);
        head.copy_from_slice(&self.fields.header());
        let (tag, mac) = match key {
            Some(key) => {
                let tag_of = |payload: &[u8]| key.page_tags().tag(self.fields.index, payload);
                let tag = if self.staged { tag_of(self.buf) } else { self.page.read(tag_of)? };
                (tag, page_mac(key, head, tag))
            }
            None => (0, Mac([0; MAC_LEN])),
        };
        seal.copy_from_slice(&page_seal(tag, &mac));
        Ok(())
    }
}

/// Decode's KV port. Dialled only once the first frame is sealed, which is sent at once:
/// decode gives a connection a short deadline to prove it holds the secret.
pub struct KvConnection<'a> {
    addr: &'a str,
    out: Option<BufWriter<TcpStream>>,
    metrics: &'a HandoffMetrics,
}

impl<'a> KvConnection<'a> {
    pub fn new(addr: &'a str, metrics: &'a HandoffMetrics) -> Self {
        KvConnection { addr, out: None, metrics }
    }

    async fn out(&mut self) -> Result<&mut BufWriter<TcpStream>, SendError> {
        if self.out.is_none() {
            let stream = TcpStream::connect(self.addr).await.map_err(|source| SendError::Connect { addr: self.addr.to_string(), source })?;
            let _ = stream.set_nodelay(true);
            self.out = Some(BufWriter::with_capacity(1 << 20, stream));
        }
        Ok(self.out.as_mut().expect("dialled above"))
    }
}

impl Sink for KvConnection<'_> {
    async fn page(&mut self, frame: &mut OutgoingPage<'_>) -> Result<(), SendError> {
        let first = self.out.is_none();
        let out = self.out().await?;
        match frame.payload() {
            Payload::Staged(payload) => {
                out.write_all(frame.head()).await?;
                out.write_all(payload).await?;
                if first {
                    out.flush().await?;
                }
            }
            Payload::InPool(page) => {
                // Whatever is buffered goes first, then head and page straight to the socket.
                out.flush().await?;
                write_in_place(out.get_ref(), frame.head(), page, frame.fields.payload_len as usize).await?;
            }
        }
        self.metrics.bytes.inc_by(frame.wire_len() as u64);
        Ok(())
    }

    async fn commit(&mut self, commit: CommitFrame, key: Option<&FrameKey>) -> Result<(), SendError> {
        let frame = Frame::Commit(commit);
        let bytes = key.map_or_else(|| frame.encode(), |k| frame.encode_signed(k));
        let out = self.out().await?;
        out.write_all(&bytes).await?;
        Ok(out.flush().await?)
    }

    async fn ack(self) -> Result<AckFrame, SendError> {
        let out = self.out.ok_or_else(|| SendError::Ack("nothing was sent".into()))?;
        read_ack(out.into_inner()).await
    }

    async fn abandon(self) -> Result<(), SendError> {
        if let Some(mut out) = self.out {
            out.flush().await?;
        }
        Ok(())
    }
}

impl Transfer<'_> {
    /// Sends the prompt's pages and the commit to decode's KV port, and reads its ack.
    pub async fn run(&self) -> Result<SendOutcome, SendError> {
        self.run_into(KvConnection::new(&self.reservation.kv_addr, self.metrics)).await
    }

    /// The same, through `sink`.
    pub async fn run_into(&self, sink: impl Sink) -> Result<SendOutcome, SendError> {
        self.send(sink, true).await
    }

    /// `run` without page tags or MACs: what the handoff bench compares the checks against
    /// (its decode's reservations skip the checks too). Only a `testing` build has it.
    #[cfg(feature = "testing")]
    pub async fn run_without_integrity(&self) -> Result<SendOutcome, SendError> {
        self.send(KvConnection::new(&self.reservation.kv_addr, self.metrics), false).await
    }

    async fn send(&self, mut sink: impl Sink, integrity: bool) -> Result<SendOutcome, SendError> {
        let r = self.reservation;
        let layout = *self.pool.layout();
        let id = check_reservation(r, self.secret, self.prompt_tokens, self.layout_fingerprint, layout.page_size)?;
        let key = integrity.then(|| self.secret.key().frame_key(id, self.tenant));
        let page_size = layout.page_size as u32;
        let page_bytes = layout.page_bytes();
        let n = r.pages.len();
        let mut tags = Vec::with_capacity(n);
        let in_place = page_bytes >= IN_PLACE_MIN_BYTES && self.pool.in_host_memory();
        // One staging buffer for every page that is copied out.
        let mut buf = vec![0u8; page_bytes];
        // What the handoff's span reports: pages and bytes sent, time spent sealing them.
        let (mut sent_pages, mut sent_bytes, mut sealing) = (0usize, 0usize, std::time::Duration::ZERO);
        for (i, &dest) in r.pages.iter().enumerate() {
            match sink.flow(i, n) {
                Flow::Send => {}
                Flow::Stop => break,
                Flow::Die => {
                    sink.abandon().await?;
                    return Ok(SendOutcome::Died);
                }
            }
            let tokens = (r.reserved_tokens - i as u32 * page_size).min(page_size);
            let fields = PageFields { handoff: id, tenant: self.tenant, index: i as u32, page: dest, tokens, payload_len: page_bytes as u32 };
            let page = PoolPage { pool: self.pool, lease: self.lease, index: i };
            let mut frame =
                if in_place && tokens == page_size { OutgoingPage::in_pool(fields, page, &mut buf) } else { OutgoingPage::staged(fields, page, &mut buf)? };
            let sealed = std::time::Instant::now();
            frame.seal(key.as_ref())?;
            sealing += sealed.elapsed();
            sink.page(&mut frame).await?;
            tags.push(frame.tag());
            (sent_pages, sent_bytes) = (sent_pages + 1, sent_bytes + frame.wire_len());
        }
        let commit = CommitFrame {
            handoff: id,
            tenant: self.tenant,
            total_tokens: r.reserved_tokens,
            page_count: n as u32,
            digest: digest(tags.iter().copied()),
            first_token: self.first_token,
            first_logprobs: self.first_logprobs.clone(),
            model_fingerprint: fingerprint_u64(self.model_fingerprint).map_err(|e| SendError::Fingerprint(format!("model fingerprint: {e}")))?,
            layout_fingerprint: fingerprint_u64(self.layout_fingerprint).map_err(|e| SendError::Fingerprint(format!("layout fingerprint: {e}")))?,
            mac: Mac([0; MAC_LEN]),
        };
        sink.commit(commit, key.as_ref()).await?;
        let span = tracing::Span::current();
        span.record("pages", sent_pages as i64);
        span.record("bytes", sent_bytes as i64);
        span.record("integrity_seconds", sealing.as_secs_f64());
        let ack = sink.ack().await?;
        if ack.ok() {
            self.metrics.size.observe((sent_pages * page_bytes) as f64);
        }
        Ok(SendOutcome::Acked(ack))
    }
}

/// Writes `head` and then the page (`len` bytes) to `socket` with non-blocking writes, the page
/// read-locked for each write only (never across a wait for the socket), so nothing copies it
/// first.
async fn write_in_place(socket: &TcpStream, head: &[u8], page: PoolPage<'_>, len: usize) -> Result<(), SendError> {
    let mut sent = 0;
    while sent < head.len() + len {
        socket.writable().await?;
        let written = page.read(|payload| {
            let (h, p) = if sent < head.len() { (&head[sent..], payload) } else { (&[][..], &payload[sent - head.len()..]) };
            socket.try_write_vectored(&[IoSlice::new(h), IoSlice::new(p)])
        })?;
        match written {
            Ok(0) => return Err(std::io::Error::from(std::io::ErrorKind::WriteZero).into()),
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

async fn read_ack(mut stream: TcpStream) -> Result<AckFrame, SendError> {
    let mut header = [0u8; HEADER_LEN];
    stream.read_exact(&mut header).await.map_err(|e| SendError::Ack(format!("decode closed the KV connection without an ack: {e}")))?;
    let h = parse_header(&header).map_err(|e| SendError::Ack(e.to_string()))?;
    if h.body_len > 1 << 16 {
        return Err(SendError::Ack(format!("ack of {} bytes is too large", h.body_len)));
    }
    let mut body = vec![0u8; h.body_len as usize];
    stream.read_exact(&mut body).await?;
    match Frame::decode_body(h.kind, &body).map_err(|e| SendError::Ack(e.to_string()))? {
        Frame::Ack(a) => Ok(a),
        other => Err(SendError::Ack(format!("expected an ack from decode, got a frame for handoff {:?}", other.handoff()))),
    }
}
