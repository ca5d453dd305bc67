//! Prefill's side of the handoff: check that decode minted the reservation, stream the prompt's
//! pages into it (each MACed with the handoff's frame key, slots past the prompt zeroed), commit,
//! and report decode's ack. Fault injection bends exactly one rule here.

use kvgate_proto::auth::{FrameKey, Mac};
use kvgate_proto::handoff::{
    AckFrame, CommitFrame, Frame, HEADER_LEN, HandoffId, MAC_LEN, PAGE_FIELDS_LEN, PAGE_TRAILER_LEN, PageFields, page_trailer, parse_header,
};
use kvgate_proto::logprobs::TokenLogprobs;
use kvgate_proto::roles::Reservation;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::TcpStream;
use xxhash_rust::xxh3::Xxh3;

use super::auth::Secret;
use super::faults::Fault;
use super::metrics::HandoffMetrics;
use super::reservations::fingerprint_u64;
use super::verify::digest;
use crate::kv::{KvError, KvPool, Lease};

/// How the transfer ended, from prefill's point of view.
#[derive(Debug)]
pub enum SendOutcome {
    /// Decode answered (accepted or refused).
    Acked(AckFrame),
    /// The die-mid-transfer fault: the connection was dropped half way.
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
}

pub struct Transfer<'a> {
    pub pool: &'a KvPool,
    pub lease: &'a Lease,
    pub reservation: &'a Reservation,
    pub secret: &'a Secret,
    pub first_token: u32,
    /// Its log-probabilities, when the client asked for them (they travel in the commit).
    pub first_logprobs: Option<TokenLogprobs>,
    pub model_fingerprint: &'a str,
    pub layout_fingerprint: &'a str,
    /// Honoured only in a build with the `testing` feature.
    pub fault: Option<Fault>,
    pub metrics: &'a HandoffMetrics,
    /// False only in the benchmark that measures what the integrity checks (checksums and
    /// MACs) cost; honoured only in a build with the `testing` feature.
    pub integrity: bool,
}

/// Checks a reservation before anything is computed or sent: decode's tag over every field
/// (so `kv_addr` is decode's own KV port), time left, the page count for the tokens, and the
/// layout. `prompt_tokens` is the prompt prefill was asked to compute.
pub fn check_reservation(r: &Reservation, secret: &Secret, prompt_tokens: usize, layout_fingerprint: &str, page_size: usize) -> Result<HandoffId, SendError> {
    let bad = |m: String| SendError::Reservation(m);
    let id: HandoffId = r.handoff_id.parse().map_err(bad)?;
    let tag = Mac::from_hex(&r.tag).map_err(|e| bad(e.to_string()))?;
    if !secret.key().reservation_tag(&r.fields(id)).verify(&tag) {
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

impl Transfer<'_> {
    /// The fault to commit: always none in a build without the `testing` feature, where every
    /// fault branch below is dead code the compiler drops.
    fn fault(&self) -> Option<Fault> {
        if cfg!(feature = "testing") { self.fault } else { None }
    }

    /// Whether checksums and MACs are computed: always, without the `testing` feature.
    fn integrity(&self) -> bool {
        self.integrity || !cfg!(feature = "testing")
    }

    pub async fn run(&self) -> Result<SendOutcome, SendError> {
        let r = self.reservation;
        let layout = *self.pool.layout();
        // The incident's bug hands a one-token placeholder to a whole prompt's reservation.
        let prompt_tokens = if self.fault() == Some(Fault::IgnoreRejection) { r.reserved_tokens as usize } else { self.lease.tokens() };
        let id = check_reservation(r, self.secret, prompt_tokens, self.layout_fingerprint, layout.page_size)?;
        let key = self.secret.key().frame_key(id);
        // Decode dials in only once the first frame is sealed, and sends that frame at once:
        // decode gives a connection a short deadline to prove it holds the secret, and reading
        // a page out of the pool may wait for a model step.
        let mut out: Option<BufWriter<TcpStream>> = None;
        let page_size = layout.page_size as u32;
        let page_bytes = layout.page_bytes();
        let n = r.pages.len();
        let mut checksums = Vec::with_capacity(n);
        // One frame buffer for every page: header and fields, the page, checksum and MAC.
        let mut frame = vec![0u8; HEADER_LEN + PAGE_FIELDS_LEN + page_bytes + PAGE_TRAILER_LEN];
        // What the handoff's span reports: pages and bytes sent, time spent sealing them.
        let (mut sent_pages, mut sent_bytes, mut sealing) = (0usize, 0usize, std::time::Duration::ZERO);
        let span = tracing::Span::current();
        let report = |pages: usize, bytes: usize, sealing: std::time::Duration| {
            span.record("pages", pages as i64);
            span.record("bytes", bytes as i64);
            span.record("integrity_seconds", sealing.as_secs_f64());
        };
        for (i, &dest) in r.pages.iter().enumerate() {
            match self.fault() {
                // The placeholder of a rejected prompt (`ignore-rejection`) has one token of KV.
                Some(Fault::TruncateTransfer | Fault::IgnoreRejection) if i >= 1 => break,
                Some(Fault::DieMidTransfer) if i >= n.div_ceil(2).max(1) => {
                    if let Some(out) = out.as_mut() {
                        out.flush().await?;
                    }
                    return Ok(SendOutcome::Died);
                }
                _ => {}
            }
            let tokens = (r.reserved_tokens - i as u32 * page_size).min(page_size);
            let mut fields = PageFields { handoff: id, index: i as u32, page: dest, tokens, payload_len: page_bytes as u32 };
            if self.fault() == Some(Fault::DropPage) && i == n / 2 {
                fields.page = u32::MAX; // lands outside the reservation; the reserved page stays unwritten
            }
            let (head, rest) = frame.split_at_mut(HEADER_LEN + PAGE_FIELDS_LEN);
            let (payload, trailer) = rest.split_at_mut(page_bytes);
            head.copy_from_slice(&fields.header());
            self.pool.access().copy_page(self.lease, i, payload)?;
            // Slots past the prompt were never written by this request: whatever is there
            // (another tenant's KV when scrubbing is off) stays here.
            for range in layout.unwritten_byte_ranges(tokens as usize) {
                payload[range].fill(0);
            }
            if self.fault() == Some(Fault::WrongLayout) {
                payload.rotate_left(page_bytes / 2);
            }
            let corrupt = self.fault() == Some(Fault::CorruptPage) && i == n / 2;
            let sealed = std::time::Instant::now();
            let (checksum, mac) = if self.integrity() { seal(&key, head, payload, corrupt) } else { (0, Mac([0; MAC_LEN])) };
            sealing += sealed.elapsed();
            (sent_pages, sent_bytes) = (sent_pages + 1, sent_bytes + HEADER_LEN + PAGE_FIELDS_LEN + page_bytes + PAGE_TRAILER_LEN);
            checksums.push(checksum);
            trailer.copy_from_slice(&page_trailer(checksum, &mac));
            if self.fault() == Some(Fault::WrongAuth) {
                trailer[PAGE_TRAILER_LEN - 1] ^= 0xff;
            }
            let out = match out.as_mut() {
                Some(out) => out,
                None => {
                    let first = out.insert(self.dial().await?);
                    first.write_all(&frame).await?;
                    first.flush().await?;
                    if self.fault() == Some(Fault::DuplicatePage) && i == n / 2 {
                        first.write_all(&frame).await?;
                    }
                    self.metrics.bytes.inc_by(frame.len() as u64);
                    continue;
                }
            };
            out.write_all(&frame).await?;
            if self.fault() == Some(Fault::DuplicatePage) && i == n / 2 {
                out.write_all(&frame).await?;
            }
            self.metrics.bytes.inc_by(frame.len() as u64);
        }
        let mut model_fp = fingerprint_u64(self.model_fingerprint);
        if self.fault() == Some(Fault::WrongFingerprint) {
            model_fp ^= 1;
        }
        let commit = CommitFrame {
            handoff: id,
            // The truncating sender claims a complete transfer, as in the incident.
            total_tokens: r.reserved_tokens,
            page_count: n as u32,
            digest: digest(checksums.iter().copied()),
            first_token: self.first_token,
            first_logprobs: self.first_logprobs.clone(),
            model_fingerprint: model_fp,
            layout_fingerprint: fingerprint_u64(self.layout_fingerprint),
            mac: Mac([0; MAC_LEN]),
        };
        let mut out = match out {
            Some(out) => out,
            None => self.dial().await?, // a reservation of no pages cannot be made; kept total
        };
        out.write_all(&self.sign(Frame::Commit(commit), &key)).await?;
        out.flush().await?;
        report(sent_pages, sent_bytes, sealing);
        let ack = read_ack(out.into_inner()).await?;
        if ack.ok {
            self.metrics.size.observe((sent_pages * page_bytes) as f64);
        }
        Ok(SendOutcome::Acked(ack))
    }

    async fn dial(&self) -> Result<BufWriter<TcpStream>, SendError> {
        let addr = &self.reservation.kv_addr;
        let stream = TcpStream::connect(addr).await.map_err(|source| SendError::Connect { addr: addr.clone(), source })?;
        let _ = stream.set_nodelay(true);
        Ok(BufWriter::with_capacity(1 << 20, stream))
    }

    /// The frame's bytes with its MAC; the wrong-auth fault spoils the MAC.
    fn sign(&self, frame: Frame, key: &kvgate_proto::auth::FrameKey) -> Vec<u8> {
        if !self.integrity() {
            return frame.encode();
        }
        let mut bytes = frame.encode_signed(key);
        if self.fault() == Some(Fault::WrongAuth) {
            let last = bytes.len() - 1;
            bytes[last] ^= 0xff;
        }
        bytes
    }
}

/// A page's checksum and MAC in one pass over it, a cache-sized chunk at a time (the MAC covers
/// header, fields, payload and checksum, in wire order). `corrupt` (the corrupt-page fault)
/// flips a payload bit after the checksum saw it and before the MAC does: a sender whose
/// memory went bad, caught by the checksum, not by authentication.
fn seal(key: &FrameKey, head: &[u8], payload: &mut [u8], corrupt: bool) -> (u64, Mac) {
    const CHUNK: usize = 256 << 10;
    let mut mac = key.streaming();
    let mut sum = Xxh3::new();
    mac.update(head);
    for (c, chunk) in payload.chunks_mut(CHUNK).enumerate() {
        sum.update(chunk);
        if corrupt && c == 0 {
            chunk[0] ^= 0x01;
        }
        mac.update(chunk);
    }
    let checksum = sum.digest();
    mac.update(&checksum.to_le_bytes());
    (checksum, mac.finish())
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
