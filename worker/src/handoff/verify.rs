//! The handoff's integrity rules, as pure functions: what a reservation expects, what has
//! arrived so far, and whether the next page or the commit may be accepted.
//!
//! Nothing here touches the pool, the clock or a metric; the reservation table
//! (`reservations.rs`) calls these before writing a page or releasing a handoff to decode, and
//! turns a `Refused` into a failed handoff.

use kvgate_proto::handoff::{CommitFrame, PageFields, TenantTag, digest};
use kvgate_proto::refusal::Mismatch;

/// Why a frame was refused, with the message the client gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub mismatch: Mismatch,
    pub message: String,
}

fn refused(mismatch: Mismatch, message: String) -> Result<(), Refused> {
    Err(Refused { mismatch, message })
}

/// What every transfer to this decode must satisfy, besides its own reservation.
#[derive(Debug, Clone, Copy)]
pub struct Rules {
    pub page_size: u32,
    pub page_bytes: usize,
    /// The model's vocabulary: a committed first token must be a token.
    pub vocab: usize,
    pub model_fingerprint: u64,
    pub layout_fingerprint: u64,
    /// Page tags, the digest and (in the table) frame MACs are checked; off only in the
    /// benchmark that measures their cost.
    pub integrity: bool,
}

/// One reservation's transfer: the pages it must fill and what has arrived.
#[derive(Debug, Clone)]
pub struct Transfer {
    /// The tenant the reservation holds room for: every frame must be sealed for it.
    pub tenant: TenantTag,
    /// The reservation's pages, in index order.
    pub pages: Vec<u32>,
    pub reserved_tokens: u32,
    /// The tag of each page index received whole so far.
    pub received: Vec<Option<u128>>,
    /// Page indexes whose frame was accepted and whose payload is still arriving: taken (a
    /// second frame for one is refused), but not received (a commit before it ends is refused).
    pub arriving: Vec<bool>,
    pub received_tokens: u32,
    /// KV bytes of the pages received (payloads), for the size histogram.
    pub received_bytes: u64,
}

impl Transfer {
    pub fn new(tenant: TenantTag, pages: Vec<u32>, reserved_tokens: u32) -> Self {
        Transfer {
            tenant,
            received: vec![None; pages.len()],
            arriving: vec![false; pages.len()],
            pages,
            reserved_tokens,
            received_tokens: 0,
            received_bytes: 0,
        }
    }

    pub fn pages_received(&self) -> usize {
        self.received.iter().filter(|r| r.is_some()).count()
    }

    /// Takes the index of a page frame `check_page_fields` accepted, before its payload is read.
    pub fn take(&mut self, f: &PageFields) {
        self.arriving[f.index as usize] = true;
    }

    /// Records a page whose payload arrived whole and matched its tag (`check_page_tag`).
    pub fn record(&mut self, f: &PageFields, tag: u128) {
        let i = f.index as usize;
        self.arriving[i] = false;
        self.received[i] = Some(tag);
        self.received_tokens += f.tokens;
        self.received_bytes += u64::from(f.payload_len);
    }
}

/// A page frame may be written (checked before its payload is read): it is sealed for the
/// reservation's tenant, it is the reservation's
/// page at its index, the index is new, it carries the tokens that index must hold, and its
/// payload is a whole page.
pub fn check_page_fields(rules: &Rules, t: &Transfer, f: &PageFields) -> Result<(), Refused> {
    let i = f.index as usize;
    if f.tenant != t.tenant {
        return refused(Mismatch::Tenant, format!("kv_handoff_tenant: page index {i} was sealed for another tenant than the reservation's"));
    }
    if t.pages.get(i) != Some(&f.page) {
        return refused(Mismatch::PageSet, format!("kv_handoff_page_set: page {} at index {i} is not part of the reservation", f.page));
    }
    if t.received[i].is_some() || t.arriving[i] {
        return refused(Mismatch::PageSet, format!("kv_handoff_page_set: page index {i} was sent twice"));
    }
    // `i` is a valid index, so `i * page_size < reserved_tokens`: no underflow.
    let expected = (t.reserved_tokens - f.index * rules.page_size).min(rules.page_size);
    if f.tokens != expected {
        return refused(Mismatch::TokenCount, format!("kv_handoff_token_count: page index {i} carries {} tokens, {expected} reserved", f.tokens));
    }
    if f.payload_len as usize != rules.page_bytes {
        return refused(Mismatch::Protocol, format!("kv_handoff_protocol: page index {i} carries {} bytes, a page is {}", f.payload_len, rules.page_bytes));
    }
    Ok(())
}

/// The payload that arrived matches the tag its frame carries (`claimed`). `payload_tag` is the
/// tag of the payload as received (the receiver computes it while the page arrives, under the
/// handoff's keys).
pub fn check_page_tag(rules: &Rules, f: &PageFields, claimed: u128, payload_tag: u128) -> Result<(), Refused> {
    if rules.integrity && payload_tag != claimed {
        let i = f.index;
        return refused(Mismatch::Checksum, format!("kv_handoff_checksum: page index {i} does not match its tag (its bytes are not the bytes prefill sealed)"));
    }
    Ok(())
}

/// A commit may release the handoff to decode: same model and layout, exactly the reserved
/// tokens in exactly the reserved pages, the digest of what arrived, and a first token of the
/// model.
pub fn check_commit(rules: &Rules, t: &Transfer, c: &CommitFrame) -> Result<(), Refused> {
    if c.tenant != t.tenant {
        return refused(Mismatch::Tenant, "kv_handoff_tenant: the commit was sealed for another tenant than the reservation's".into());
    }
    if c.model_fingerprint != rules.model_fingerprint || c.layout_fingerprint != rules.layout_fingerprint {
        return refused(
            Mismatch::Fingerprint,
            format!(
                "kv_handoff_fingerprint: sender model/layout {:016x}/{:016x} != decode {:016x}/{:016x}",
                c.model_fingerprint, c.layout_fingerprint, rules.model_fingerprint, rules.layout_fingerprint
            ),
        );
    }
    if c.total_tokens != t.reserved_tokens || t.received_tokens != t.reserved_tokens {
        return refused(Mismatch::TokenCount, format!("kv_handoff_incomplete: received {} of {} reserved tokens", t.received_tokens, t.reserved_tokens));
    }
    let missing = t.received.len() - t.pages_received();
    if missing > 0 || c.page_count as usize != t.pages.len() {
        return refused(Mismatch::PageSet, format!("kv_handoff_page_set: {missing} of {} reserved pages never arrived", t.pages.len()));
    }
    if rules.integrity && digest(t.received.iter().map(|r| r.unwrap_or_default())) != c.digest {
        return refused(Mismatch::Checksum, "kv_handoff_checksum: the commit digest does not match the pages received".into());
    }
    if c.first_token as usize >= rules.vocab {
        return refused(
            Mismatch::FirstToken,
            format!("kv_handoff_first_token: the committed first token {} is outside the vocabulary of {} tokens", c.first_token, rules.vocab),
        );
    }
    Ok(())
}

#[cfg(test)]
#[path = "verify_tests.rs"]
mod tests;
