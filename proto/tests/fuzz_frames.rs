//! Fuzzing the frame decoder (proptest, a fixed budget per run: `KVGATE_FUZZ_CASES`, default
//! 16384 cases per property; `make fuzz` runs many more). Properties: any bytes decode to a frame
//! or an error, never a panic; nothing larger than the input is allocated; and a MACed frame
//! altered in any way no longer verifies (its MAC, and a page's tag over its payload).

use kvgate_proto::auth::{DeploymentKey, Mac};
use kvgate_proto::handoff::{CommitFrame, Frame, HEADER_LEN, HandoffId, MAC_LEN, PageFrame, TenantTag};
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("KVGATE_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(16384)
}

fn page(payload: Vec<u8>, index: u32, tokens: u32) -> Frame {
    Frame::Page(PageFrame {
        handoff: HandoffId(7),
        tenant: TenantTag::of("acme"),
        index,
        page: index.wrapping_mul(3),
        tokens,
        tag: 1,
        payload,
        mac: Mac([0; MAC_LEN]),
    })
}

fn commit(first_token: u32, total_tokens: u32) -> Frame {
    Frame::Commit(CommitFrame {
        handoff: HandoffId(7),
        tenant: TenantTag::of("acme"),
        total_tokens,
        page_count: 3,
        digest: 9,
        first_token,
        model_fingerprint: 1,
        layout_fingerprint: 2,
        first_logprobs: None,
        mac: Mac([0; MAC_LEN]),
    })
}

fn frames() -> impl Strategy<Value = Frame> {
    prop_oneof![
        (proptest::collection::vec(any::<u8>(), 0..512), any::<u32>(), any::<u32>()).prop_map(|(p, i, t)| page(p, i, t)),
        (any::<u32>(), any::<u32>()).prop_map(|(f, t)| commit(f, t)),
    ]
}

/// One edit of a byte string: flip, overwrite, insert, delete or truncate.
#[derive(Debug, Clone)]
enum Edit {
    Flip(usize, u8),
    Set(usize, u8),
    Insert(usize, u8),
    Delete(usize),
    Truncate(usize),
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    let edit = prop_oneof![
        (any::<usize>(), 1..=255u8).prop_map(|(i, b)| Edit::Flip(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Set(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Insert(i, b)),
        any::<usize>().prop_map(Edit::Delete),
        any::<usize>().prop_map(Edit::Truncate),
    ];
    proptest::collection::vec(edit, 1..6)
}

fn apply(bytes: &mut Vec<u8>, edits: &[Edit]) {
    for e in edits {
        let n = bytes.len().max(1);
        match *e {
            Edit::Flip(i, b) if !bytes.is_empty() => bytes[i % n] ^= b,
            Edit::Set(i, b) if !bytes.is_empty() => bytes[i % n] = b,
            Edit::Insert(i, b) => bytes.insert(i % (bytes.len() + 1), b),
            Edit::Delete(i) if !bytes.is_empty() => {
                bytes.remove(i % n);
            }
            Edit::Truncate(i) => bytes.truncate(i % (bytes.len() + 1)),
            _ => {}
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_decode_or_error_without_allocating_more_than_they_hold(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
        if let Ok((frame, used)) = Frame::decode(&bytes) {
            prop_assert!(used <= bytes.len());
            if let Frame::Page(p) = frame {
                prop_assert!(p.payload.len() <= bytes.len());
            }
        }
    }

    #[test]
    fn an_edited_signed_frame_never_verifies(frame in frames(), edits in edits(), secret in proptest::collection::vec(any::<u8>(), 16..64)) {
        let key = DeploymentKey::new(&secret).unwrap().frame_key(HandoffId(7), TenantTag::of("acme"));
        let original = frame.encode_signed(&key);
        let mut bytes = original.clone();
        apply(&mut bytes, &edits);
        if let Ok((decoded, used)) = Frame::decode(&bytes) {
            let header: [u8; HEADER_LEN] = bytes[..HEADER_LEN].try_into().unwrap();
            let verifies = decoded.verifies(&key, &header, &bytes[HEADER_LEN..used]);
            prop_assert!(!verifies || bytes[..used] == original[..], "an altered frame verified");
        }
    }
}
