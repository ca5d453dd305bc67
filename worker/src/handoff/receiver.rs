//! Decode's KV port: reads length-prefixed frames from prefill peers, hands each to the
//! reservation table, and answers the commit with an ack.

use std::sync::Arc;

use kvgate_proto::handoff::{AckFrame, Frame, HEADER_LEN, HandoffId, parse_header};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::reservations::{Reservations, Verdict};

/// Room for a page frame's fixed fields on top of the page itself.
const PAGE_FRAME_OVERHEAD: usize = 256;

pub async fn serve(listener: TcpListener, table: Arc<Reservations>) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let table = table.clone();
                tokio::spawn(async move {
                    if let Err(e) = connection(stream, &table).await {
                        tracing::debug!(%peer, error = %e, "KV connection ended");
                    }
                });
            }
            Err(e) => tracing::warn!(error = %e, "accepting a KV connection failed"),
        }
    }
}

async fn connection(mut stream: TcpStream, table: &Reservations) -> std::io::Result<()> {
    let _ = stream.set_nodelay(true);
    let max_body = table.page_bytes() + PAGE_FRAME_OVERHEAD;
    // The handoff this connection is carrying, once its first frame named one.
    let mut bound: Option<HandoffId> = None;
    let mut body = Vec::new();
    loop {
        let mut header = [0u8; HEADER_LEN];
        if let Err(e) = stream.read_exact(&mut header).await {
            if let Some(id) = bound {
                table.connection_lost(id);
            }
            return Err(e);
        }
        let frame = match parse_header(&header) {
            Ok(h) if h.body_len as usize > max_body => Err(format!("frame body of {} bytes exceeds {max_body}", h.body_len)),
            Ok(h) => {
                body.resize(h.body_len as usize, 0);
                if let Err(e) = stream.read_exact(&mut body).await {
                    if let Some(id) = bound {
                        table.connection_lost(id);
                    }
                    return Err(e);
                }
                Frame::decode_body(h.kind, &body).map_err(|e| e.to_string())
            }
            Err(e) => Err(e.to_string()),
        };
        let result = match frame {
            Ok(Frame::Page(p)) => {
                bound = Some(p.handoff);
                table.accept_page(&p).map(|_| false)
            }
            Ok(Frame::Commit(c)) => {
                bound = Some(c.handoff);
                table.accept_commit(&c).map(|_| true)
            }
            Ok(Frame::Ack(_)) => Err(Verdict { reason: "page_set", message: "kv_handoff_protocol: decode does not accept acks".into() }),
            Err(e) => {
                // Unparseable bytes: the transfer cannot be trusted.
                if let Some(id) = bound {
                    table.connection_lost(id);
                }
                Err(Verdict { reason: "checksum", message: format!("kv_handoff_protocol: {e}") })
            }
        };
        match result {
            Ok(false) => continue,
            Ok(true) => {
                ack(&mut stream, AckFrame { ok: true, reason: String::new(), message: String::new() }).await?;
                return Ok(());
            }
            Err(v) => {
                tracing::warn!(reason = v.reason, message = %v.message, "KV handoff refused");
                ack(&mut stream, AckFrame { ok: false, reason: v.reason.into(), message: v.message }).await?;
                return Ok(());
            }
        }
    }
}

async fn ack(stream: &mut TcpStream, a: AckFrame) -> std::io::Result<()> {
    stream.write_all(&Frame::Ack(a).encode()).await?;
    stream.shutdown().await
}
