//! The KV handoff wire format, version 6 (see `docs/handoff-protocol.md`).
//!
//! Every frame is `header | body`. The header is 12 bytes, little-endian:
//! `magic "KVGF" | version u16 | kind u8 | flags u8 | body_len u32`. `body_len` is checked
//! against [`MAX_BODY`] *before* anything is allocated, so a hostile length cannot make the
//! reader allocate. A page body is `fields | tag | MAC | payload`: the tag covers the payload
//! ([`crate::page_tag`]), the MAC (keyed BLAKE3, see [`crate::auth`]) the header, the fields
//! and the tag, so decode knows a page frame is authentic before its payload arrives. A commit
//! body ends with a MAC over the header and the rest of the body.

use std::fmt;

use crate::auth::FrameKey;
pub use crate::auth::{MAC_LEN, Mac};
use crate::logprobs::{MAX_TOP_LOGPROBS, TokenLogprobs};
pub use crate::page_tag::TAG_LEN;
use crate::refusal::Refusal;

/// Frame magic.
pub const MAGIC: [u8; 4] = *b"KVGF";
/// Protocol version this build speaks.
pub const VERSION: u16 = 6;
/// Header length in bytes.
pub const HEADER_LEN: usize = 12;
/// Largest body accepted (a page of a large model fits with room to spare).
pub const MAX_BODY: u32 = 64 << 20;
/// A page body's fixed fields before the payload: handoff, tenant, index, page, tokens, payload
/// length.
pub const PAGE_FIELDS_LEN: usize = 48;
/// A page body's tag and MAC, between its fields and its payload.
pub const PAGE_SEAL_LEN: usize = TAG_LEN + MAC_LEN;

pub use crate::handoff_id::HandoffId;
pub use crate::tenant_tag::TenantTag;

/// One page of KV on its way from prefill to decode, whole: the protocol's reference encoding,
/// which tests, the fuzzer and forging peers write. The worker never builds one: its sender
/// writes the same bytes straight from the pool, and its receiver reads a page's head before
/// its payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageFrame {
    pub handoff: HandoffId,
    /// The tenant whose request the KV was computed for.
    pub tenant: TenantTag,
    /// Position of the page in the reservation (0-based).
    pub index: u32,
    /// Decode-side page id it must land in.
    pub page: u32,
    /// Tokens in this page (the last page may be partial).
    pub tokens: u32,
    /// The payload's tag ([`crate::page_tag`]): its checksum, and its MAC under the handoff's
    /// keys.
    pub tag: u128,
    /// Keyed BLAKE3 with the handoff's frame key over the header, the fields and the tag.
    pub mac: Mac,
    pub payload: Vec<u8>,
}

impl PageFrame {
    pub fn view(&self) -> PageView<'_> {
        PageView { fields: self.fields(), tag: self.tag, payload: &self.payload, mac: self.mac }
    }

    fn fields(&self) -> PageFields {
        PageFields {
            handoff: self.handoff,
            tenant: self.tenant,
            index: self.index,
            page: self.page,
            tokens: self.tokens,
            payload_len: self.payload.len() as u32,
        }
    }
}

/// The fields a page body starts with, which a receiver reads before the payload (so it knows
/// the handoff's key and the payload's length before the payload arrives).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageFields {
    pub handoff: HandoffId,
    pub tenant: TenantTag,
    pub index: u32,
    pub page: u32,
    pub tokens: u32,
    pub payload_len: u32,
}

impl PageFields {
    pub fn encode(&self) -> [u8; PAGE_FIELDS_LEN] {
        let mut out = [0u8; PAGE_FIELDS_LEN];
        out[..16].copy_from_slice(&self.handoff.0.to_le_bytes());
        out[16..32].copy_from_slice(&self.tenant.0);
        for (i, v) in [self.index, self.page, self.tokens, self.payload_len].into_iter().enumerate() {
            out[32 + 4 * i..36 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        out
    }

    pub fn decode(b: &[u8; PAGE_FIELDS_LEN]) -> PageFields {
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        PageFields {
            handoff: HandoffId(u128::from_le_bytes(b[..16].try_into().expect("16 bytes"))),
            tenant: TenantTag(b[16..32].try_into().expect("16 bytes")),
            index: u32_at(32),
            page: u32_at(36),
            tokens: u32_at(40),
            payload_len: u32_at(44),
        }
    }

    /// The page header a sender writes before the payload: frame header and these fields.
    pub fn header(&self) -> [u8; HEADER_LEN + PAGE_FIELDS_LEN] {
        let body_len = (PAGE_FIELDS_LEN + PAGE_SEAL_LEN + self.payload_len as usize) as u32;
        let mut out = [0u8; HEADER_LEN + PAGE_FIELDS_LEN];
        out[..HEADER_LEN].copy_from_slice(&frame_header(KIND_PAGE, body_len));
        out[HEADER_LEN..].copy_from_slice(&self.encode());
        out
    }
}

/// A page frame whose payload is borrowed: what the receiver checks in place, without copying
/// a page it may refuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageView<'a> {
    pub fields: PageFields,
    pub tag: u128,
    pub mac: Mac,
    pub payload: &'a [u8],
}

impl PageView<'_> {
    pub fn to_owned(&self) -> PageFrame {
        let f = self.fields;
        PageFrame {
            handoff: f.handoff,
            tenant: f.tenant,
            index: f.index,
            page: f.page,
            tokens: f.tokens,
            tag: self.tag,
            payload: self.payload.to_vec(),
            mac: self.mac,
        }
    }
}

/// A page frame's seal: the payload's tag, then the MAC over header, fields and tag.
pub fn page_seal(tag: u128, mac: &Mac) -> [u8; PAGE_SEAL_LEN] {
    let mut out = [0u8; PAGE_SEAL_LEN];
    out[..TAG_LEN].copy_from_slice(&tag.to_le_bytes());
    out[TAG_LEN..].copy_from_slice(&mac.0);
    out
}

/// A page frame's MAC: over its header and fields as written (`head`), then its tag.
pub fn page_mac(key: &FrameKey, head: &[u8], tag: u128) -> Mac {
    key.mac(&[head, &tag.to_le_bytes()])
}

/// The digest a commit carries: the first 8 bytes of BLAKE3 over the page tags in index order.
pub fn digest(tags: impl IntoIterator<Item = u128>) -> u64 {
    let mut h = blake3::Hasher::new();
    for c in tags {
        h.update(&c.to_le_bytes());
    }
    u64::from_le_bytes(h.finalize().as_bytes()[..8].try_into().expect("8 bytes"))
}

fn frame_header(kind: u8, body_len: u32) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    out[..4].copy_from_slice(&MAGIC);
    out[4..6].copy_from_slice(&VERSION.to_le_bytes());
    out[6] = kind;
    out[8..].copy_from_slice(&body_len.to_le_bytes());
    out
}

/// The end of a transfer: what the sender claims it sent.
#[derive(Debug, Clone, PartialEq)]
pub struct CommitFrame {
    pub handoff: HandoffId,
    pub tenant: TenantTag,
    pub total_tokens: u32,
    pub page_count: u32,
    /// [`digest`] of the page tags in index order.
    pub digest: u64,
    /// The first token, sampled by prefill from the last prompt position.
    pub first_token: u32,
    pub model_fingerprint: u64,
    pub layout_fingerprint: u64,
    /// The first token's log-probabilities, when the client asked for them.
    pub first_logprobs: Option<TokenLogprobs>,
    /// Keyed BLAKE3 with the handoff's frame key over the header and every field above, so
    /// `first_token` and the digest are as unforgeable as the pages.
    pub mac: Mac,
}

/// Decode's answer to a transfer: accepted, or refused for one reason, with a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AckFrame {
    /// `None`: committed.
    pub refused: Option<Refusal>,
    pub message: String,
}

impl AckFrame {
    pub fn accepted() -> AckFrame {
        AckFrame { refused: None, message: String::new() }
    }

    pub fn refused(reason: impl Into<Refusal>, message: String) -> AckFrame {
        AckFrame { refused: Some(reason.into()), message }
    }

    pub fn ok(&self) -> bool {
        self.refused.is_none()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    Page(PageFrame),
    Commit(CommitFrame),
    Ack(AckFrame),
}

/// The kind byte of a page frame (its body is read field by field, see [`PageFields`]).
pub const KIND_PAGE: u8 = 1;
const KIND_COMMIT: u8 = 2;
const KIND_ACK: u8 = 3;

/// Why bytes are not a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    BadMagic([u8; 4]),
    UnsupportedVersion(u16),
    UnknownKind(u8),
    TooLarge(u32),
    Truncated { needed: usize, have: usize },
    Malformed(&'static str),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::BadMagic(m) => write!(f, "not a kvgate frame (magic {m:02x?})"),
            FrameError::UnsupportedVersion(v) => write!(f, "handoff protocol version {v} is not supported (this build speaks {VERSION})"),
            FrameError::UnknownKind(k) => write!(f, "unknown frame kind {k}"),
            FrameError::TooLarge(n) => write!(f, "frame body of {n} bytes exceeds the {MAX_BODY}-byte limit"),
            FrameError::Truncated { needed, have } => write!(f, "frame truncated: needs {needed} bytes, has {have}"),
            FrameError::Malformed(what) => write!(f, "malformed frame: {what}"),
        }
    }
}

impl std::error::Error for FrameError {}

/// Parsed header: kind and body length (already bounded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: u8,
    pub body_len: u32,
}

pub fn parse_header(b: &[u8; HEADER_LEN]) -> Result<Header, FrameError> {
    let magic = [b[0], b[1], b[2], b[3]];
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([b[4], b[5]]);
    if version != VERSION {
        return Err(FrameError::UnsupportedVersion(version));
    }
    let kind = b[6];
    if !matches!(kind, KIND_PAGE | KIND_COMMIT | KIND_ACK) {
        return Err(FrameError::UnknownKind(kind));
    }
    let body_len = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
    if body_len > MAX_BODY {
        return Err(FrameError::TooLarge(body_len));
    }
    Ok(Header { kind, body_len })
}

impl Frame {
    /// Header and body, ready for the wire, with the MAC field as it is in the frame.
    pub fn encode(&self) -> Vec<u8> {
        let payload_len = match self {
            Frame::Page(p) => p.payload.len(),
            _ => 0,
        };
        let mut out = Vec::with_capacity(HEADER_LEN + 128 + payload_len);
        out.extend_from_slice(&frame_header(self.kind(), 0)); // body length, filled in below
        match self {
            Frame::Page(p) => {
                out.extend_from_slice(&p.fields().encode());
                out.extend_from_slice(&page_seal(p.tag, &p.mac));
                out.extend_from_slice(&p.payload);
            }
            Frame::Commit(c) => {
                out.extend_from_slice(&c.handoff.0.to_le_bytes());
                out.extend_from_slice(&c.tenant.0);
                for v in [c.total_tokens, c.page_count] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                out.extend_from_slice(&c.digest.to_le_bytes());
                out.extend_from_slice(&c.first_token.to_le_bytes());
                out.extend_from_slice(&c.model_fingerprint.to_le_bytes());
                out.extend_from_slice(&c.layout_fingerprint.to_le_bytes());
                match &c.first_logprobs {
                    None => out.push(0),
                    Some(l) => {
                        out.push(1);
                        out.extend_from_slice(&l.logprob.to_le_bytes());
                        out.push(l.top.len() as u8);
                        for (id, logprob) in &l.top {
                            out.extend_from_slice(&id.to_le_bytes());
                            out.extend_from_slice(&logprob.to_le_bytes());
                        }
                    }
                }
                out.extend_from_slice(&c.mac.0);
            }
            Frame::Ack(a) => {
                out.push(a.ok() as u8);
                for s in [a.refused.map_or("", Refusal::as_str), a.message.as_str()] {
                    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
                    out.extend_from_slice(s.as_bytes());
                }
            }
        }
        let body_len = (out.len() - HEADER_LEN) as u32;
        out[8..12].copy_from_slice(&body_len.to_le_bytes());
        out
    }

    /// Encodes a page or commit frame with its MAC computed under `key`, and a page with its
    /// tag too (the MAC and tag fields of `self` are ignored). Acks carry no MAC and are encoded
    /// as they are.
    pub fn encode_signed(&self, key: &FrameKey) -> Vec<u8> {
        match self {
            Frame::Page(p) => {
                let tag = key.page_tags().tag(p.index, &p.payload);
                let head = p.fields().header();
                Frame::Page(PageFrame { tag, mac: page_mac(key, &head, tag), ..p.clone() }).encode()
            }
            Frame::Commit(_) => {
                let mut out = self.encode();
                let at = out.len() - MAC_LEN;
                let mac = key.mac(&[&out[..at]]);
                out[at..].copy_from_slice(&mac.0);
                out
            }
            Frame::Ack(_) => self.encode(),
        }
    }

    /// Page and commit frames carry a MAC; acks do not.
    pub fn is_signed(&self) -> bool {
        !matches!(self, Frame::Ack(_))
    }

    /// The MAC a signed frame carries.
    pub fn mac(&self) -> Option<&Mac> {
        match self {
            Frame::Page(p) => Some(&p.mac),
            Frame::Commit(c) => Some(&c.mac),
            Frame::Ack(_) => None,
        }
    }

    /// The tenant a page or commit frame was sealed for.
    pub fn tenant(&self) -> Option<TenantTag> {
        match self {
            Frame::Page(p) => Some(p.tenant),
            Frame::Commit(c) => Some(c.tenant),
            Frame::Ack(_) => None,
        }
    }

    /// The handoff a page or commit frame names.
    pub fn handoff(&self) -> Option<HandoffId> {
        match self {
            Frame::Page(p) => Some(p.handoff),
            Frame::Commit(c) => Some(c.handoff),
            Frame::Ack(_) => None,
        }
    }

    /// Whether `mac()` is the MAC under `key` of this frame as received (`header` and `body`
    /// exactly as they were read). A page's payload is not covered here: its tag is (checked
    /// against the payload by decode's rules).
    pub fn mac_verifies(&self, key: &FrameKey, header: &[u8; HEADER_LEN], body: &[u8]) -> bool {
        let signed = match self {
            Frame::Page(_) => PAGE_FIELDS_LEN + TAG_LEN,
            _ => body.len().saturating_sub(MAC_LEN),
        };
        match self.mac() {
            Some(mac) if body.len() >= signed + MAC_LEN => key.mac(&[&header[..], &body[..signed]]).verify(mac),
            _ => false,
        }
    }

    /// Everything decode checks of a frame's authenticity: its MAC, and a page's tag over its
    /// payload (decode checks the two apart: a page altered after its tag was taken is a
    /// `checksum` refusal, a frame without the key's MAC an `auth` one).
    pub fn verifies(&self, key: &FrameKey, header: &[u8; HEADER_LEN], body: &[u8]) -> bool {
        self.mac_verifies(key, header, body)
            && match self {
                Frame::Page(p) => key.page_tags().tag(p.index, &p.payload) == p.tag,
                _ => true,
            }
    }

    fn kind(&self) -> u8 {
        match self {
            Frame::Page(_) => KIND_PAGE,
            Frame::Commit(_) => KIND_COMMIT,
            Frame::Ack(_) => KIND_ACK,
        }
    }

    /// Decodes one body of `kind`. Every length inside is checked against the bytes present.
    pub fn decode_body(kind: u8, body: &[u8]) -> Result<Frame, FrameError> {
        let mut r = Reader { b: body, at: 0 };
        let frame = match kind {
            // Checks its own length, trailing bytes included.
            KIND_PAGE => return Ok(Frame::Page(PageView::decode_body(body)?.to_owned())),
            KIND_COMMIT => Frame::Commit(CommitFrame {
                handoff: HandoffId(r.u128()?),
                tenant: TenantTag(r.bytes(16)?.try_into().unwrap()),
                total_tokens: r.u32()?,
                page_count: r.u32()?,
                digest: r.u64()?,
                first_token: r.u32()?,
                model_fingerprint: r.u64()?,
                layout_fingerprint: r.u64()?,
                first_logprobs: match r.bytes(1)?[0] {
                    0 => None,
                    1 => {
                        let logprob = f32::from_bits(r.u32()?);
                        let n = r.bytes(1)?[0] as usize;
                        if n > MAX_TOP_LOGPROBS {
                            return Err(FrameError::Malformed("a commit carries at most 20 top log-probabilities"));
                        }
                        let top = (0..n).map(|_| Ok((r.u32()?, f32::from_bits(r.u32()?)))).collect::<Result<_, FrameError>>()?;
                        Some(TokenLogprobs { logprob, top })
                    }
                    _ => return Err(FrameError::Malformed("first-logprobs flag must be 0 or 1")),
                },
                mac: r.mac()?,
            }),
            KIND_ACK => {
                let ok = match r.bytes(1)?[0] {
                    0 => false,
                    1 => true,
                    _ => return Err(FrameError::Malformed("ack flag must be 0 or 1")),
                };
                let reason = r.string()?;
                let refused = match (ok, reason.as_str()) {
                    (true, "") => None,
                    (true, _) => return Err(FrameError::Malformed("an accepting ack carries no reason")),
                    (false, reason) => Some(Refusal::parse(reason).ok_or(FrameError::Malformed("an ack's reason is not a refusal reason"))?),
                };
                Frame::Ack(AckFrame { refused, message: r.string()? })
            }
            other => return Err(FrameError::UnknownKind(other)),
        };
        if r.at != body.len() {
            return Err(FrameError::Malformed("trailing bytes after the frame body"));
        }
        Ok(frame)
    }

    /// Decodes one whole frame (header and body) from `bytes`, returning it and its length.
    pub fn decode(bytes: &[u8]) -> Result<(Frame, usize), FrameError> {
        let header: &[u8; HEADER_LEN] =
            bytes.get(..HEADER_LEN).and_then(|h| h.try_into().ok()).ok_or(FrameError::Truncated { needed: HEADER_LEN, have: bytes.len() })?;
        let h = parse_header(header)?;
        let end = HEADER_LEN + h.body_len as usize;
        let body = bytes.get(HEADER_LEN..end).ok_or(FrameError::Truncated { needed: end, have: bytes.len() })?;
        Ok((Frame::decode_body(h.kind, body)?, end))
    }
}

impl<'a> PageView<'a> {
    /// A page body read in place. The payload length inside is checked against the body.
    pub fn decode_body(body: &'a [u8]) -> Result<PageView<'a>, FrameError> {
        let fields: &[u8; PAGE_FIELDS_LEN] =
            body.get(..PAGE_FIELDS_LEN).and_then(|b| b.try_into().ok()).ok_or(FrameError::Truncated { needed: PAGE_FIELDS_LEN, have: body.len() })?;
        let fields = PageFields::decode(fields);
        let mut r = Reader { b: body, at: PAGE_FIELDS_LEN };
        let tag = r.u128()?;
        let mac = r.mac()?;
        let payload = r.bytes(fields.payload_len as usize)?;
        if r.at != body.len() {
            return Err(FrameError::Malformed("trailing bytes after the frame body"));
        }
        Ok(PageView { fields, tag, mac, payload })
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        let end = self.at.checked_add(n).ok_or(FrameError::Malformed("length overflow"))?;
        let s = self.b.get(self.at..end).ok_or(FrameError::Truncated { needed: end, have: self.b.len() })?;
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().unwrap()))
    }
    fn u128(&mut self) -> Result<u128, FrameError> {
        Ok(u128::from_le_bytes(self.bytes(16)?.try_into().unwrap()))
    }
    fn mac(&mut self) -> Result<Mac, FrameError> {
        Ok(Mac(self.bytes(MAC_LEN)?.try_into().unwrap()))
    }
    fn string(&mut self) -> Result<String, FrameError> {
        let n = self.u32()? as usize;
        String::from_utf8(self.bytes(n)?.to_vec()).map_err(|_| FrameError::Malformed("string is not UTF-8"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::refusal::Mismatch;

    fn page() -> Frame {
        Frame::Page(PageFrame {
            handoff: HandoffId(42),
            tenant: TenantTag::of("acme"),
            index: 1,
            page: 9,
            tokens: 16,
            tag: 0xabc,
            payload: vec![1, 2, 3],
            mac: Mac([7; MAC_LEN]),
        })
    }

    #[test]
    fn every_kind_round_trips() {
        let frames = [
            page(),
            Frame::Commit(CommitFrame {
                handoff: HandoffId(u128::MAX),
                tenant: TenantTag::of("acme"),
                total_tokens: 681_280,
                page_count: 42_580,
                digest: 5,
                first_token: 65,
                model_fingerprint: 6,
                layout_fingerprint: 7,
                first_logprobs: Some(TokenLogprobs { logprob: -0.25, top: vec![(65, -0.25), (3, -1.5)] }),
                mac: Mac([1; MAC_LEN]),
            }),
            Frame::Ack(AckFrame::refused(Mismatch::TokenCount, "received 16 of 681280".into())),
        ];
        for f in frames {
            let bytes = f.encode();
            assert_eq!(Frame::decode(&bytes), Ok((f, bytes.len())));
        }
    }

    #[test]
    fn a_signed_frame_verifies_and_any_flipped_bit_does_not() {
        let key = crate::auth::DeploymentKey::new(&[9; 32]).unwrap().frame_key(HandoffId(42), TenantTag::of("acme"));
        let bytes = page().encode_signed(&key);
        // What decode checks: the MAC over header, fields and tag, and the tag over the payload.
        let check = |bytes: &[u8]| {
            let header: [u8; HEADER_LEN] = bytes[..HEADER_LEN].try_into().unwrap();
            let body = &bytes[HEADER_LEN..];
            Frame::decode(bytes).is_ok_and(|(f, _)| f.verifies(&key, &header, body))
        };
        assert!(check(&bytes));
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert!(!check(&b), "flipping byte {i} went unnoticed");
        }
        let other = crate::auth::DeploymentKey::new(&[9; 32]).unwrap().frame_key(HandoffId(43), TenantTag::of("acme"));
        assert!(!Frame::decode(&bytes).unwrap().0.verifies(&other, bytes[..HEADER_LEN].try_into().unwrap(), &bytes[HEADER_LEN..]));
    }

    #[test]
    fn hostile_headers_are_refused_before_allocating() {
        let mut bytes = page().encode();
        bytes[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Frame::decode(&bytes), Err(FrameError::TooLarge(u32::MAX)));
        let mut bytes = page().encode();
        bytes[4] = 9;
        assert_eq!(Frame::decode(&bytes), Err(FrameError::UnsupportedVersion(9)));
        let mut bytes = page().encode();
        bytes[0] = b'X';
        assert!(matches!(Frame::decode(&bytes), Err(FrameError::BadMagic(_))));
    }

    #[test]
    fn an_ack_carries_no_reason_or_one_refusal_reason() {
        let encode = |ok: u8, reason: &str| {
            let honest = Frame::Ack(AckFrame::accepted()).encode();
            let mut body = vec![ok];
            for s in [reason, "why"] {
                body.extend_from_slice(&(s.len() as u32).to_le_bytes());
                body.extend_from_slice(s.as_bytes());
            }
            let mut out = honest[..HEADER_LEN].to_vec();
            out[8..12].copy_from_slice(&(body.len() as u32).to_le_bytes());
            out.extend_from_slice(&body);
            Frame::decode(&out).map(|(f, _)| f)
        };
        let refused = encode(0, "tenant").unwrap();
        assert_eq!(refused, Frame::Ack(AckFrame::refused(Mismatch::Tenant, "why".into())));
        assert!(matches!(encode(0, "gremlins"), Err(FrameError::Malformed(m)) if m.contains("not a refusal reason")));
        assert!(matches!(encode(1, "checksum"), Err(FrameError::Malformed(m)) if m.contains("no reason")));
    }

    #[test]
    fn an_inner_length_past_the_body_is_truncation_not_a_panic() {
        let mut bytes = page().encode();
        // payload_len is the last of the fixed fields.
        let at = HEADER_LEN + PAGE_FIELDS_LEN - 4;
        bytes[at..at + 4].copy_from_slice(&1_000_000u32.to_le_bytes());
        assert!(matches!(Frame::decode(&bytes), Err(FrameError::Truncated { .. })));
    }

    #[test]
    fn any_prefix_or_bit_flip_decodes_or_errors_without_panicking() {
        let bytes = page().encode();
        for n in 0..bytes.len() {
            let _ = Frame::decode(&bytes[..n]);
        }
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                let _ = Frame::decode(&b);
            }
        }
    }

    #[test]
    fn handoff_ids_print_and_parse_as_hex() {
        let id = HandoffId(0x1234);
        let text = id.to_string();
        assert_eq!(text.len(), 32);
        assert_eq!(text.parse::<HandoffId>(), Ok(id));
        assert!("xyz".parse::<HandoffId>().is_err());
    }

    #[test]
    fn a_reservation_carries_its_id_and_tag_as_hex_and_a_malformed_one_is_refused_where_it_is_read() {
        use crate::auth::Mac;
        use crate::roles::Reservation;
        let r = Reservation {
            handoff_id: HandoffId(0xabc),
            pages: vec![1],
            reserved_tokens: 3,
            max_tokens: 1,
            expires_ms: 9,
            tag: Mac([7; MAC_LEN]),
            kv_addr: "127.0.0.1:1".into(),
            model_fingerprint: "0".repeat(16),
            layout_fingerprint: "1".repeat(16),
            tenant: crate::tenant_id::TenantId::parse("acme").unwrap(),
        };
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["handoff_id"], "00000000000000000000000000000abc");
        assert_eq!(json["tag"], "07".repeat(MAC_LEN));
        assert_eq!(serde_json::from_value::<Reservation>(json.clone()).unwrap(), r);
        let plus = format!("+{}", "0".repeat(31));
        for (field, bad) in [("handoff_id", "abc"), ("handoff_id", "zz000000000000000000000000000000"), ("handoff_id", plus.as_str()), ("tag", "00")] {
            let mut forged = json.clone();
            forged[field] = bad.into();
            let e = serde_json::from_value::<Reservation>(forged).unwrap_err().to_string();
            assert!(e.contains("hex digits"), "{field}={bad}: {e}");
        }
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;

    /// Property: arbitrary bytes decode to a frame or an error; never a panic, and never an
    /// allocation larger than the bytes present (payloads are copied from the input only).
    #[test]
    fn random_bytes_never_panic_the_decoder() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let valid = Frame::Commit(CommitFrame {
            handoff: HandoffId(1),
            tenant: TenantTag::of("acme"),
            total_tokens: 1,
            page_count: 1,
            digest: 0,
            first_token: 0,
            model_fingerprint: 0,
            layout_fingerprint: 0,
            first_logprobs: None,
            mac: Mac([0; MAC_LEN]),
        })
        .encode();
        for round in 0..20_000 {
            let len = (next() % 160) as usize;
            let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if round % 2 == 0 && len >= HEADER_LEN {
                // Keep a valid header half the time so the body parsers are exercised too.
                bytes[..HEADER_LEN].copy_from_slice(&valid[..HEADER_LEN]);
                bytes[6] = 1 + (next() % 3) as u8;
                let body_len = (len - HEADER_LEN) as u32;
                bytes[8..12].copy_from_slice(&body_len.to_le_bytes());
            }
            if let Ok((frame, used)) = Frame::decode(&bytes) {
                assert!(used <= bytes.len());
                if let Frame::Page(p) = frame {
                    assert!(p.payload.len() <= bytes.len());
                }
            }
        }
    }
}
