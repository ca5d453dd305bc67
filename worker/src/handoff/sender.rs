//! Prefill's side of the handoff: stream the prompt's pages into decode's reservation, commit,
//! and report decode's ack. Fault injection bends exactly one rule here.

use kvgate_proto::handoff::{AckFrame, CommitFrame, Frame, HEADER_LEN, HandoffId, PageFrame, parse_header};
use kvgate_proto::roles::Reservation;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::TcpStream;
use xxhash_rust::xxh3::xxh3_64;

use super::auth::tag_from_hex;
use super::faults::Fault;
use super::metrics::HandoffMetrics;
use super::reservations::{digest, fingerprint_u64};
use crate::kv::{KvPool, Lease};

/// How the transfer ended, from prefill's point of view.
#[derive(Debug)]
pub enum SendOutcome {
    /// Decode answered (accepted or refused).
    Acked(AckFrame),
    /// The die-mid-transfer fault: the connection was dropped half way.
    Died,
}

pub struct Transfer<'a> {
    pub pool: &'a KvPool,
    pub lease: &'a Lease,
    pub reservation: &'a Reservation,
    pub first_token: u32,
    pub model_fingerprint: &'a str,
    pub layout_fingerprint: &'a str,
    pub fault: Option<Fault>,
    pub metrics: &'a HandoffMetrics,
    /// False only in the benchmark that measures what checksumming costs.
    pub checksums: bool,
}

impl Transfer<'_> {
    pub async fn run(&self) -> Result<SendOutcome, String> {
        let r = self.reservation;
        let id: HandoffId = r.handoff_id.parse()?;
        let mut tag = tag_from_hex(&r.tag)?;
        if self.fault == Some(Fault::WrongAuth) {
            tag[0] ^= 0xff;
        }
        let stream = TcpStream::connect(&r.kv_addr).await.map_err(|e| format!("connecting to decode's KV port {}: {e}", r.kv_addr))?;
        let _ = stream.set_nodelay(true);
        let mut out = BufWriter::with_capacity(1 << 20, stream);
        let page_size = self.pool.layout().page_size as u32;
        let n = r.pages.len();
        let mut checksums = Vec::with_capacity(n);
        for (i, &dest) in r.pages.iter().enumerate() {
            match self.fault {
                Some(Fault::TruncateTransfer) if i >= 1 => break,
                Some(Fault::DieMidTransfer) if i >= n.div_ceil(2).max(1) => {
                    out.flush().await.map_err(|e| e.to_string())?;
                    return Ok(SendOutcome::Died);
                }
                _ => {}
            }
            let payload = self.pool.access().page_bytes(self.lease, i).map_err(|e| e.to_string())?;
            let checksum = if self.checksums { xxh3_64(&payload) } else { 0 };
            checksums.push(checksum);
            let mut frame = PageFrame {
                handoff: id,
                tag,
                index: i as u32,
                page: dest,
                tokens: (r.reserved_tokens - i as u32 * page_size).min(page_size),
                checksum,
                payload,
            };
            if self.fault == Some(Fault::CorruptPage) && i == n / 2 {
                frame.payload[0] ^= 0x01;
            }
            if self.fault == Some(Fault::DropPage) && i == n / 2 {
                frame.page = u32::MAX; // lands outside the reservation; the reserved page stays unwritten
            }
            let bytes = Frame::Page(frame).encode();
            out.write_all(&bytes).await.map_err(|e| e.to_string())?;
            if self.fault == Some(Fault::DuplicatePage) && i == n / 2 {
                out.write_all(&bytes).await.map_err(|e| e.to_string())?;
            }
            self.metrics.bytes.inc_by(bytes.len() as u64);
        }
        let mut model_fp = fingerprint_u64(self.model_fingerprint);
        if self.fault == Some(Fault::WrongFingerprint) {
            model_fp ^= 1;
        }
        let commit = CommitFrame {
            handoff: id,
            tag,
            // The truncating sender claims a complete transfer, as in the incident.
            total_tokens: r.reserved_tokens,
            page_count: n as u32,
            digest: digest(checksums.iter().copied()),
            first_token: self.first_token,
            model_fingerprint: model_fp,
            layout_fingerprint: fingerprint_u64(self.layout_fingerprint),
        };
        out.write_all(&Frame::Commit(commit).encode()).await.map_err(|e| e.to_string())?;
        out.flush().await.map_err(|e| e.to_string())?;
        read_ack(out.into_inner()).await.map(SendOutcome::Acked)
    }
}

async fn read_ack(mut stream: TcpStream) -> Result<AckFrame, String> {
    let mut header = [0u8; HEADER_LEN];
    stream.read_exact(&mut header).await.map_err(|e| format!("decode closed the KV connection without an ack: {e}"))?;
    let h = parse_header(&header).map_err(|e| e.to_string())?;
    if h.body_len > 1 << 16 {
        return Err(format!("ack of {} bytes is too large", h.body_len));
    }
    let mut body = vec![0u8; h.body_len as usize];
    stream.read_exact(&mut body).await.map_err(|e| e.to_string())?;
    match Frame::decode_body(h.kind, &body).map_err(|e| e.to_string())? {
        Frame::Ack(a) => Ok(a),
        other => Err(format!("expected an ack from decode, got {other:?}")),
    }
}
