//! A hand-written client of decode's KV port: it writes frames byte for byte, MACed with the
//! deployment's key when it plays a peer, or with whatever an attacker would put there.

use kvgate_proto::auth::{FrameKey, Mac};
use kvgate_proto::handoff::{CommitFrame, Frame, HEADER_LEN, HandoffId, MAC_LEN, PageFrame, TenantTag, digest, parse_header};
use kvgate_proto::roles::Reservation;
use kvgate_worker::handoff::Secret;
use kvgate_worker::roles::internal_auth::Signer;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::Worker;

pub struct KvClient {
    pub reservation: Reservation,
    pub page_bytes: usize,
    pub page_size: u32,
    /// The tenant its frames are sealed for (the reservation's, unless told otherwise).
    tenant: TenantTag,
    /// The handoff's frame key, when this client holds the secret.
    key: Option<FrameKey>,
}

/// The tenant [`KvClient::reserve`] reserves for.
pub const TENANT: &str = "kv-client";

impl KvClient {
    /// Reserves `prompt_tokens` on decode as a router would (signed).
    pub async fn reserve(w: &Worker, signer: &Signer, prompt_tokens: u32, max_tokens: u32) -> KvClient {
        let body = json!({"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "tenant": TENANT});
        let (status, body) = w.post_signed(signer, "/internal/v1/reserve", &body).await;
        assert_eq!(status, 200, "{body}");
        let reservation: Reservation = serde_json::from_value(body).unwrap();
        let (_, report) = w.get("/v1/kv-pool").await;
        let report: kvgate_proto::CapacityReport = serde_json::from_str(&report).unwrap();
        let page_bytes = (report.bytes_per_token * report.page_size as u64) as usize;
        let tenant = reservation.tenant.tag();
        KvClient { reservation, page_bytes, page_size: report.page_size as u32, tenant, key: None }
    }

    /// Frames from now on carry MACs under the deployment's key (a peer, not an attacker).
    pub fn holding(mut self, secret: &Secret) -> KvClient {
        self.key = Some(secret.key().frame_key(self.id(), self.tenant));
        self
    }

    /// Frames from now on are sealed for `tenant` (with the secret: authentic, but another
    /// tenant's KV when `tenant` is not the reservation's).
    pub fn sealed_for(mut self, secret: &Secret, tenant: &str) -> KvClient {
        self.tenant = TenantTag::of(tenant);
        self.holding(secret)
    }

    pub fn id(&self) -> HandoffId {
        self.reservation.handoff_id
    }

    fn encode(&self, frame: Frame) -> Vec<u8> {
        match &self.key {
            Some(k) => frame.encode_signed(k),
            None => frame.encode(), // a tag and MAC of zeros: what someone without the secret can do
        }
    }

    /// Page frame `index` (zeros), for `handoff` (normally `self.id()`).
    pub fn page(&self, index: u32, handoff: HandoffId) -> Vec<u8> {
        let payload = vec![0u8; self.page_bytes];
        let tokens = (self.reservation.reserved_tokens - index * self.page_size).min(self.page_size);
        let page = self.reservation.pages[index as usize];
        self.encode(Frame::Page(PageFrame { handoff, tenant: self.tenant, index, page, tokens, tag: 0, payload, mac: Mac([0; MAC_LEN]) }))
    }

    /// Every page of the reservation.
    pub fn pages(&self) -> Vec<Vec<u8>> {
        (0..self.reservation.pages.len() as u32).map(|i| self.page(i, self.id())).collect()
    }

    /// The commit of a complete transfer of zero pages (its digest over their tags, when this
    /// client holds the secret).
    pub fn commit(&self, first_token: u32) -> Vec<u8> {
        let zeros = vec![0u8; self.page_bytes];
        let tags = (0..self.reservation.pages.len() as u32).map(|i| self.key.as_ref().map_or(0, |k| k.page_tags().tag(i, &zeros)));
        self.encode(Frame::Commit(CommitFrame {
            handoff: self.id(),
            tenant: self.tenant,
            total_tokens: self.reservation.reserved_tokens,
            page_count: self.reservation.pages.len() as u32,
            digest: digest(tags),
            first_token,
            model_fingerprint: u64::from_str_radix(&self.reservation.model_fingerprint, 16).unwrap(),
            layout_fingerprint: u64::from_str_radix(&self.reservation.layout_fingerprint, 16).unwrap(),
            first_logprobs: None,
            mac: Mac([0; MAC_LEN]),
        }))
    }

    /// Sends `frames` on one connection and returns decode's ack: (ok, reason, message).
    pub async fn send(&self, frames: &[Vec<u8>]) -> (bool, String, String) {
        send_raw(&self.reservation.kv_addr, frames).await
    }
}

/// Writes raw bytes to a KV port and reads its ack: (ok, reason, message).
pub async fn send_raw(kv_addr: &str, frames: &[Vec<u8>]) -> (bool, String, String) {
    let mut s = tokio::net::TcpStream::connect(kv_addr).await.unwrap();
    for f in frames {
        if s.write_all(f).await.is_err() {
            break; // decode already refused and closed
        }
    }
    let mut header = [0u8; HEADER_LEN];
    s.read_exact(&mut header).await.unwrap();
    let h = parse_header(&header).unwrap();
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).await.unwrap();
    match Frame::decode_body(h.kind, &body).unwrap() {
        Frame::Ack(a) => (a.ok(), a.refused.map_or(String::new(), |r| r.as_str().to_string()), a.message),
        other => panic!("expected an ack, got {other:?}"),
    }
}
