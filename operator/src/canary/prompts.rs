//! The canary's prompts: fixed token-id sequences, so two runs (and two revisions) are compared
//! on the same input.

/// Token ids below this are in every vocabulary the canary meets on an external engine: the
/// byte range of a byte-fallback one.
pub const ENGINE_VOCAB: u32 = 259;

/// `count` prompts with lengths from one page up to `max_len` tokens, spaced geometrically (short
/// prompts test the first page, long ones many pages and chunked prefill), ids in `1..vocab`
/// from a fixed xorshift sequence per prompt.
pub fn prompts(count: u32, page_size: u32, max_len: u64, vocab: u32) -> Vec<Vec<u32>> {
    let (first, last) = (u64::from(page_size).clamp(1, max_len.max(1)), max_len.max(1));
    (0..count)
        .map(|i| {
            let len = if count == 1 { last } else { (first as f64 * (last as f64 / first as f64).powf(f64::from(i) / f64::from(count - 1))).round() as u64 };
            of_len(len.clamp(first.min(last), last), vocab, u64::from(i + 1))
        })
        .collect()
}

/// One prompt of exactly `len` tokens, ids in `1..vocab` from a fixed sequence seeded by `seed`.
pub fn of_len(len: u64, vocab: u32, seed: u64) -> Vec<u32> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ seed;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            1 + (x % u64::from(vocab.max(2) - 1)) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_span_one_page_to_the_maximum_and_ids_stay_in_the_vocabulary() {
        let p = prompts(3, 16, 1024, 258);
        assert_eq!(p.iter().map(Vec::len).collect::<Vec<_>>(), [16, 128, 1024]);
        assert!(p.iter().flatten().all(|&t| (1..258).contains(&t)));
        assert_eq!(p, prompts(3, 16, 1024, 258), "the same prompts every time");
        assert_ne!(p[1][..16], p[0][..], "prompts differ from each other");
        assert_eq!(prompts(1, 16, 40, 258)[0].len(), 40);
        // A window smaller than a page: one prompt of the window.
        assert_eq!(prompts(2, 16, 8, 258).iter().map(Vec::len).collect::<Vec<_>>(), [8, 8]);
    }
}
