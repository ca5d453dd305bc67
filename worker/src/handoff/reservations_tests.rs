//! The reservation table over a small host pool: every bound checked at reserve and commit, and
//! integrity refusals kept apart from protocol noise.

use kvgate_proto::tenant_id::TenantId;
use std::time::Duration;

use kvgate_proto::auth::Mac;
use kvgate_proto::handoff::{CommitFrame, HandoffId, MAC_LEN, PageFrame, TenantTag, digest};
use prometheus::Registry;

use super::*;
use crate::kv::{KvDtype, KvLayout};

const PAGE: usize = 4;
/// The tenant the tests reserve for.
const ACME: &str = "acme";

fn acme() -> TenantId {
    TenantId::parse(ACME).unwrap()
}

struct Fixture {
    table: Reservations,
    page_bytes: usize,
}

fn fixture(timeout: Duration) -> Fixture {
    let layout = KvLayout { num_layers: 1, num_kv_heads: 1, head_dim: 2, page_size: PAGE, dtype: KvDtype::F32 };
    let pool = KvPool::host(layout, 16).unwrap();
    let config = TableConfig {
        timeout,
        limits: Limits { window: 40, vocab: 100, max_open: 3 },
        kv_addr: "127.0.0.1:1".into(),
        model_fingerprint: format!("{:016x}", 0xa),
        layout_fingerprint: format!("{:016x}", 0xb),
    };
    let table = Reservations::new(pool, Secret::new(&[3; 32]).unwrap(), config, HandoffMetrics::new(&Registry::new(), "decode")).unwrap();
    Fixture { page_bytes: layout.page_bytes(), table }
}

/// The tag of page `index` of handoff `id` under the table's secret.
fn tag(table: &Reservations, id: HandoffId, index: u32, payload: &[u8]) -> u128 {
    table.frame_key(id, TenantTag::of(ACME)).expect("checks on").page_tags().tag(index, payload)
}

/// `accept_page` of a whole frame, its payload's tag computed as the receiver does.
fn accept(table: &Reservations, p: &PageFrame, authentic: bool) -> Result<(), HandoffRefusal> {
    table.accept_page(&p.view(), authentic, tag(table, p.handoff, p.index, &p.payload))
}

impl Fixture {
    fn page(&self, issued: &Issued, index: u32) -> PageFrame {
        let payload = vec![index as u8 + 1; self.page_bytes];
        let tokens = (issued.reserved_tokens - index * PAGE as u32).min(PAGE as u32);
        let tag = tag(&self.table, issued.id, index, &payload);
        PageFrame { handoff: issued.id, tenant: TenantTag::of(ACME), index, page: issued.pages[index as usize], tokens, tag, payload, mac: Mac([0; MAC_LEN]) }
    }

    fn commit(&self, issued: &Issued, first_token: u32) -> CommitFrame {
        let sums = (0..issued.pages.len() as u32).map(|i| self.page(issued, i).tag);
        CommitFrame {
            handoff: issued.id,
            tenant: TenantTag::of(ACME),
            total_tokens: issued.reserved_tokens,
            page_count: issued.pages.len() as u32,
            digest: digest(sums),
            first_token,
            model_fingerprint: 0xa,
            layout_fingerprint: 0xb,
            first_logprobs: None,
            mac: Mac([0; MAC_LEN]),
        }
    }

    fn mismatch(&self, reason: &str) -> u64 {
        self.table.metrics.mismatch.with_label_values(&[reason]).get()
    }

    fn protocol(&self, reason: &str) -> u64 {
        self.table.metrics.kv_port_rejected.with_label_values(&[reason]).get()
    }

    fn mismatches(&self) -> u64 {
        Mismatch::ALL.iter().map(|m| self.mismatch(m.as_str())).sum()
    }
}

#[test]
fn reservations_are_checked_before_any_page_is_taken() {
    let f = fixture(Duration::from_secs(5));
    let invalid = |r: Result<Issued, ReserveError>| match r {
        Err(ReserveError::Invalid { field, .. }) => field,
        other => panic!("{other:?}"),
    };
    assert_eq!(invalid(f.table.reserve(0, 4, &acme())), "prompt_tokens");
    assert_eq!(invalid(f.table.reserve(4, 0, &acme())), "max_tokens");
    // 16 + (2^32 - 1) used to wrap around to 15 tokens: one page.
    assert_eq!(invalid(f.table.reserve(16, u32::MAX, &acme())), "max_tokens");
    assert_eq!(f.table.reserve(30, 11, &acme()).unwrap_err(), ReserveError::ContextLength { prompt: 30, max_tokens: 11, window: 40 });
    assert_eq!(f.table.pool.used_pages(), 0);
    let held: Vec<Issued> = (0..3).map(|_| f.table.reserve(1, 1, &acme()).unwrap()).collect();
    assert_eq!(f.table.reserve(1, 1, &acme()).unwrap_err(), ReserveError::TooMany { open: 3, limit: 3 });
    f.table.cancel(held[0].id, false).unwrap();
    assert!(f.table.reserve(1, 1, &acme()).is_ok(), "a cancelled reservation frees its slot");
}

#[test]
fn a_whole_authenticated_transfer_commits_and_keeps_the_reserved_bounds() {
    let f = fixture(Duration::from_secs(5));
    let issued = f.table.reserve(6, 3, &acme()).unwrap();
    assert_eq!((issued.pages.len(), issued.max_tokens), (2, 3));
    for i in 0..2 {
        accept(&f.table, &f.page(&issued, i), true).unwrap();
    }
    f.table.accept_commit(&f.commit(&issued, 7), true).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let committed = rt.block_on(f.table.take_committed(issued.id, None, &acme())).unwrap();
    assert_eq!((committed.first_token, committed.reserved_tokens, committed.max_tokens), (7, 6, 3));
    assert_eq!(f.mismatches(), 0);
}

#[test]
fn a_committed_handoff_is_decoded_for_its_own_tenant_only() {
    let f = fixture(Duration::from_secs(5));
    let issued = f.table.reserve(6, 3, &acme()).unwrap();
    for i in 0..2 {
        accept(&f.table, &f.page(&issued, i), true).unwrap();
    }
    f.table.accept_commit(&f.commit(&issued, 7), true).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let v = rt.block_on(f.table.take_committed(issued.id, None, &TenantId::parse("globex").unwrap())).unwrap_err();
    assert_eq!(v.reason.as_str(), "tenant");
    assert_eq!(v.message, format!("kv_handoff_tenant: handoff {} was reserved for tenant `acme`, tenant `globex` asked to decode it", issued.id));
    assert_eq!(f.mismatch("tenant"), 1);
    assert_eq!(f.table.metrics.mismatch_by_tenant.with_label_values(&["acme", "tenant"]).get(), 1, "counted under the tenant it was reserved for");
    assert_eq!(f.table.pool.used_pages(), 0, "its pages are freed unread");
    assert!(rt.block_on(f.table.take_committed(issued.id, None, &acme())).is_err(), "and nobody decodes it after");
}

#[test]
fn a_page_sealed_for_another_tenant_fails_the_handoff_before_a_byte_is_written() {
    let f = fixture(Duration::from_secs(5));
    let issued = f.table.reserve(6, 3, &acme()).unwrap();
    let globex = PageFrame { tenant: TenantTag::of("globex"), ..f.page(&issued, 0) };
    let Err(v) = f.table.claim_page(&globex.view().fields, globex.tag, true) else { panic!("claimed") };
    assert_eq!(v.reason.as_str(), "tenant");
    assert_eq!(f.mismatch("tenant"), 1);
    assert_eq!(f.table.pool.used_pages(), 0);
}

#[test]
fn a_first_token_outside_the_vocabulary_is_refused_at_commit() {
    let f = fixture(Duration::from_secs(5));
    let issued = f.table.reserve(2, 2, &acme()).unwrap();
    accept(&f.table, &f.page(&issued, 0), true).unwrap();
    let v = f.table.accept_commit(&f.commit(&issued, 100_000), true).unwrap_err();
    assert_eq!(v.reason.as_str(), "first_token");
    assert!(v.message.contains("100000") && v.message.contains("100 tokens"), "{}", v.message);
    assert_eq!(f.table.pool.used_pages(), 0, "the failed handoff's pages are freed at once");
}

#[test]
fn an_unauthenticated_frame_on_a_live_handoff_fails_it_as_forged() {
    let f = fixture(Duration::from_secs(5));
    let issued = f.table.reserve(2, 2, &acme()).unwrap();
    let v = accept(&f.table, &f.page(&issued, 0), false).unwrap_err();
    assert_eq!(v.reason.as_str(), "auth");
    assert_eq!(f.mismatch("auth"), 1);
    assert_eq!(f.table.pool.used_pages(), 0);
}

#[test]
fn frames_nobody_with_the_secret_sent_are_protocol_noise_not_integrity_events() {
    let f = fixture(Duration::from_secs(5));
    let issued = f.table.reserve(2, 2, &acme()).unwrap();
    let mut stray = f.page(&issued, 0);
    stray.handoff = HandoffId(12345);
    assert_eq!(accept(&f.table, &stray, false).unwrap_err().reason.as_str(), "unauthenticated");
    assert_eq!((f.protocol("unauthenticated"), f.mismatches()), (1, 0));
    // The same frame from a holder of the secret is evidence: a transfer for no reservation.
    assert_eq!(accept(&f.table, &stray, true).unwrap_err().reason.as_str(), "unknown_handoff");
    assert_eq!(f.mismatch("unknown_handoff"), 1);
    // The live reservation was not disturbed.
    accept(&f.table, &f.page(&issued, 0), true).unwrap();
    f.table.accept_commit(&f.commit(&issued, 1), true).unwrap();
}

#[test]
fn a_frame_after_the_deadline_is_refused_before_the_sweeper_runs() {
    let f = fixture(Duration::from_millis(30));
    let issued = f.table.reserve(6, 2, &acme()).unwrap();
    accept(&f.table, &f.page(&issued, 0), true).unwrap();
    std::thread::sleep(Duration::from_millis(60));
    let v = accept(&f.table, &f.page(&issued, 1), true).unwrap_err();
    assert_eq!(v.reason.as_str(), "timeout");
    assert!(v.message.contains("1 of 2 pages"), "{}", v.message);
    assert_eq!(f.mismatch("timeout"), 1);
    assert_eq!(f.table.pool.used_pages(), 0);
}

#[test]
fn an_unused_reservation_expires_without_an_integrity_mismatch() {
    let f = fixture(Duration::from_millis(20));
    let unused = f.table.reserve(6, 2, &acme()).unwrap();
    let partial = f.table.reserve(6, 2, &acme()).unwrap();
    accept(&f.table, &f.page(&partial, 0), true).unwrap();
    std::thread::sleep(Duration::from_millis(40));
    f.table.expire();
    assert_eq!(f.table.metrics.expired.get(), 2);
    assert_eq!(f.mismatch("timeout"), 1, "only the transfer that stopped half way is a mismatch");
    assert_eq!(f.table.pool.used_pages(), 0);
    let late = f.page(&unused, 0);
    assert_eq!(accept(&f.table, &late, true).unwrap_err().reason.as_str(), "timeout");
}

#[test]
fn page_set_token_count_and_tag_rules_hold() {
    let f = fixture(Duration::from_secs(5));
    let reason = |frame: PageFrame| {
        let issued = f.table.reserve(6, 2, &acme()).unwrap();
        let frame = PageFrame { handoff: issued.id, page: if frame.page == u32::MAX { u32::MAX } else { issued.pages[frame.index as usize] }, ..frame };
        accept(&f.table, &frame, true).unwrap_err().reason.as_str()
    };
    let template = |issued: &Issued| f.page(issued, 1);
    let base = template(&f.table.reserve(6, 2, &acme()).unwrap());
    assert_eq!(reason(PageFrame { page: u32::MAX, ..base.clone() }), "page_set");
    assert_eq!(reason(PageFrame { tokens: 3, ..base.clone() }), "token_count");
    assert_eq!(reason(PageFrame { tag: 1, ..base.clone() }), "checksum");
    // Twice the same index.
    let issued = f.table.reserve(6, 2, &acme()).unwrap();
    accept(&f.table, &f.page(&issued, 0), true).unwrap();
    assert_eq!(accept(&f.table, &f.page(&issued, 0), true).unwrap_err().reason.as_str(), "page_set");
    // A commit before the last page.
    let issued = f.table.reserve(6, 2, &acme()).unwrap();
    accept(&f.table, &f.page(&issued, 0), true).unwrap();
    assert_eq!(f.table.accept_commit(&f.commit(&issued, 1), true).unwrap_err().reason.as_str(), "token_count");
}

#[test]
fn replayed_frames_and_frames_of_an_earlier_generation_of_the_same_pages_are_refused() {
    let f = fixture(Duration::from_secs(5));
    // Replay: every frame of a committed transfer sent again.
    let done = f.table.reserve(6, 2, &acme()).unwrap();
    let frames: Vec<PageFrame> = (0..2).map(|i| f.page(&done, i)).collect();
    for p in &frames {
        accept(&f.table, p, true).unwrap();
    }
    f.table.accept_commit(&f.commit(&done, 1), true).unwrap();
    assert_eq!(accept(&f.table, &frames[0], true).unwrap_err().reason.as_str(), "unknown_handoff");
    assert_eq!(f.table.accept_commit(&f.commit(&done, 1), true).unwrap_err().reason.as_str(), "unknown_handoff");
    assert_eq!(f.mismatch("unknown_handoff"), 2);
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    drop(rt.block_on(f.table.take_committed(done.id, None, &acme())).unwrap());

    // An earlier generation: a late frame of a cancelled handoff, addressed to a page the next
    // reservation now holds, must not land in it.
    let old = f.table.reserve(6, 2, &acme()).unwrap();
    f.table.cancel(old.id, false).unwrap();
    let new = f.table.reserve(6, 2, &acme()).unwrap();
    let stale = PageFrame { page: new.pages[0], ..f.page(&old, 0) };
    assert_eq!(accept(&f.table, &stale, true).unwrap_err().reason.as_str(), "unknown_handoff");
    for i in 0..2 {
        accept(&f.table, &f.page(&new, i), true).unwrap();
    }
    f.table.accept_commit(&f.commit(&new, 1), true).unwrap();
}

#[test]
fn a_malformed_fingerprint_is_an_error_never_a_number_that_might_match() {
    assert_eq!(super::fingerprint_u64("00000000000000ff"), Ok(255));
    for bad in ["", "ff", "zz00000000000000", "000000000000000000", "+0000000000000ff"] {
        assert!(super::fingerprint_u64(bad).unwrap_err().contains("16 hex digits"), "{bad:?}");
    }
}
