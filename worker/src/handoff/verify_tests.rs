//! Every rule of `verify`, one row per way a transfer can go wrong, over a reservation of three
//! pages of 4 tokens holding 10 tokens (the last page is partial).

use kvgate_proto::auth::{DeploymentKey, Mac};
use kvgate_proto::handoff::{HandoffId, MAC_LEN, PageFrame, TenantTag};

use super::*;

const RULES: Rules = Rules { page_size: 4, page_bytes: 8, vocab: 100, model_fingerprint: 0xa, layout_fingerprint: 0xb, integrity: true };
const PAGES: [u32; 3] = [7, 3, 11];
const TOKENS: u32 = 10;

fn acme() -> TenantTag {
    TenantTag::of("acme")
}

fn transfer() -> Transfer {
    Transfer::new(acme(), PAGES.to_vec(), TOKENS)
}

/// Page `index`'s tag under a fixed key (the rules compare tags; the key is the receiver's).
fn tag(index: u32, payload: &[u8]) -> u128 {
    DeploymentKey::new(&[1; 16]).unwrap().frame_key(HandoffId(1), acme()).page_tags().tag(index, payload)
}

fn page(index: u32) -> PageFrame {
    let payload = vec![index as u8 + 1; RULES.page_bytes];
    let tokens = (TOKENS - index * RULES.page_size).min(RULES.page_size);
    PageFrame { handoff: HandoffId(1), tenant: acme(), index, page: PAGES[index as usize], tokens, tag: tag(index, &payload), payload, mac: Mac([0; MAC_LEN]) }
}

/// Both checks of a whole frame, its payload's tag computed as the receiver does.
fn check(rules: &Rules, t: &Transfer, f: &PageFrame) -> Result<(), Refused> {
    let fields = f.view().fields;
    check_page_fields(rules, t, &fields)?;
    check_page_tag(rules, &fields, f.tag, tag(f.index, &f.payload))
}

fn commit(t: &Transfer) -> CommitFrame {
    CommitFrame {
        handoff: HandoffId(1),
        tenant: acme(),
        total_tokens: TOKENS,
        page_count: PAGES.len() as u32,
        digest: digest(t.received.iter().map(|r| r.unwrap_or_default())),
        first_token: 5,
        model_fingerprint: 0xa,
        layout_fingerprint: 0xb,
        first_logprobs: None,
        mac: Mac([0; MAC_LEN]),
    }
}

/// Feeds pages in the given order (each must pass), then returns the transfer.
fn after(order: &[u32]) -> Transfer {
    let mut t = transfer();
    for &i in order {
        let f = page(i);
        check(&RULES, &t, &f).unwrap_or_else(|e| panic!("page {i}: {e:?}"));
        t.record(&f.view().fields, f.tag);
    }
    t
}

fn reason(r: Result<(), Refused>) -> Option<&'static str> {
    r.err().map(|e| e.mismatch.as_str())
}

#[test]
fn a_whole_transfer_in_any_order_commits() {
    for order in [[0, 1, 2], [2, 0, 1], [1, 2, 0]] {
        let t = after(&order);
        assert_eq!(t.received_tokens, TOKENS);
        assert_eq!(check_commit(&RULES, &t, &commit(&t)), Ok(()), "order {order:?}");
    }
}

#[test]
fn every_page_rule_refuses_with_its_own_reason() {
    let wrong_page = PageFrame { page: 8, ..page(1) };
    let outside = PageFrame { index: 3, ..page(1) };
    let stale_generation = PageFrame { page: PAGES[0], ..page(1) }; // a page of this pool, not at this index
    let short = PageFrame { tokens: 3, ..page(2) }; // the last page holds 2
    let long = PageFrame { tokens: 4, ..page(2) };
    let padded = PageFrame { tokens: 1, ..page(1) };
    let mut flipped = page(1);
    flipped.payload[0] ^= 1;
    let truncated = PageFrame { payload: vec![2; 4], ..page(1) };
    let globex = PageFrame { tenant: TenantTag::of("globex"), ..page(1) };
    let rows: [(&str, PageFrame, Option<&str>); 10] = [
        ("an honest page", page(1), None),
        ("a page id outside the reservation", wrong_page, Some("page_set")),
        ("an index past the reservation", outside, Some("page_set")),
        ("another index's page", stale_generation, Some("page_set")),
        ("one token short", short, Some("token_count")),
        ("one token over", long, Some("token_count")),
        ("a full page claiming one token", padded, Some("token_count")),
        ("a flipped byte", flipped, Some("checksum")),
        ("half a page", truncated, Some("protocol")),
        ("another tenant's page", globex, Some("tenant")),
    ];
    for (what, frame, want) in rows {
        assert_eq!(reason(check(&RULES, &transfer(), &frame)), want, "{what}");
    }
}

#[test]
fn a_page_written_twice_is_refused_even_with_the_same_bytes() {
    let t = after(&[0, 1]);
    let r = check(&RULES, &t, &page(1)).unwrap_err();
    assert_eq!((r.mismatch, r.message.as_str()), (Mismatch::PageSet, "kv_handoff_page_set: page index 1 was sent twice"));
}

#[test]
fn a_page_still_arriving_is_taken_but_not_received() {
    // Pages 0 and 1 in; page 2's frame accepted, its payload still on the wire.
    let mut t = after(&[0, 1]);
    t.take(&page(2).view().fields);
    let r = check(&RULES, &t, &page(2)).unwrap_err();
    assert_eq!(r.mismatch, Mismatch::PageSet, "a second frame for it: {r:?}");
    // A commit (from another connection) before its payload is in is refused.
    let whole = after(&[0, 1, 2]);
    assert_eq!(reason(check_commit(&RULES, &t, &commit(&whole))), Some("token_count"));
    t.record(&page(2).view().fields, page(2).tag);
    assert_eq!(check_commit(&RULES, &t, &commit(&whole)), Ok(()));
}

#[test]
fn every_commit_rule_refuses_with_its_own_reason() {
    let whole = after(&[0, 1, 2]);
    let honest = commit(&whole);
    let rows: [(&str, Transfer, CommitFrame, Option<&str>); 10] = [
        ("an honest commit", whole.clone(), honest.clone(), None),
        ("before the last page", after(&[0, 1]), honest.clone(), Some("token_count")),
        ("with no page at all", transfer(), honest.clone(), Some("token_count")),
        ("claiming one token fewer", whole.clone(), CommitFrame { total_tokens: TOKENS - 1, ..honest.clone() }, Some("token_count")),
        ("claiming one token more", whole.clone(), CommitFrame { total_tokens: TOKENS + 1, ..honest.clone() }, Some("token_count")),
        ("claiming another page count", whole.clone(), CommitFrame { page_count: 2, ..honest.clone() }, Some("page_set")),
        ("with another digest", whole.clone(), CommitFrame { digest: honest.digest ^ 1, ..honest.clone() }, Some("checksum")),
        ("from another model", whole.clone(), CommitFrame { model_fingerprint: 0xc, ..honest.clone() }, Some("fingerprint")),
        ("with a first token past the vocabulary", whole.clone(), CommitFrame { first_token: 100, ..honest.clone() }, Some("first_token")),
        ("sealed for another tenant", whole.clone(), CommitFrame { tenant: TenantTag::of("globex"), ..honest.clone() }, Some("tenant")),
    ];
    for (what, t, c, want) in rows {
        assert_eq!(reason(check_commit(&RULES, &t, &c)), want, "a commit {what}");
    }
    let layout = CommitFrame { layout_fingerprint: 0xc, ..honest };
    assert_eq!(reason(check_commit(&RULES, &whole, &layout)), Some("fingerprint"));
}

#[test]
fn the_incomplete_message_gives_both_numbers() {
    let t = after(&[0]);
    let r = check_commit(&RULES, &t, &commit(&t)).unwrap_err();
    assert_eq!(r.message, "kv_handoff_incomplete: received 4 of 10 reserved tokens");
}

#[test]
fn without_integrity_checks_only_the_tags_and_digest_are_skipped() {
    let off = Rules { integrity: false, ..RULES };
    let mut flipped = page(0);
    flipped.payload[0] ^= 1;
    assert_eq!(check(&off, &transfer(), &flipped), Ok(()));
    assert_eq!(reason(check(&off, &transfer(), &PageFrame { tokens: 1, ..page(0) })), Some("token_count"));
    let t = after(&[0, 1, 2]);
    assert_eq!(check_commit(&off, &t, &CommitFrame { digest: 0, ..commit(&t) }), Ok(()));
}
