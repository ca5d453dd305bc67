//! POLYVAL (RFC 8452), the universal hash under every page's tag (`page_tag.rs`).
//!
//! Where the CPU multiplies carry-less on 256-bit registers (VPCLMULQDQ with AVX2: Intel Ice
//! Lake, AMD Zen 3 and later), sixteen blocks share one reduction, two blocks per instruction,
//! against precomputed powers of the key, three products per pair of blocks (Karatsuba). Elsewhere the RustCrypto `polyval` crate runs
//! (PCLMULQDQ one block at a time, or constant-time software). Both are the same function
//! (tested on random keys and lengths), so peers on different CPUs agree on every tag.

use polyval::universal_hash::{KeyInit, UniversalHash};

const BLOCK: usize = 16;
/// Blocks folded into one reduction on the wide path (16 measured faster than 8 here).
const GROUP: usize = 16;

/// POLYVAL under one key, fed in pieces of any length; the input is zero-padded to whole
/// blocks when it is finished.
pub struct Polyval {
    engine: Engine,
    pending: [u8; BLOCK],
    pending_len: usize,
}

// One per page being hashed, on the stack: the size of the wide variant costs nothing.
#[allow(clippy::large_enum_variant)]
enum Engine {
    /// `powers[i]` is H^(GROUP - i) (in POLYVAL's product), so a group's first block meets
    /// the highest power.
    Wide {
        powers: [u128; GROUP],
        acc: u128,
    },
    Crate(polyval::Polyval),
}

/// Which implementation this CPU runs.
pub fn implementation() -> &'static str {
    if wide::available() { "VPCLMULQDQ, 16 blocks per reduction" } else { "RustCrypto polyval (PCLMULQDQ or software)" }
}

/// A POLYVAL key with what the wide path derives from it (its powers), made once per key rather
/// than once per message.
#[derive(Clone)]
pub struct Key {
    h: u128,
    powers: Option<[u128; GROUP]>,
}

impl Key {
    pub fn new(h: u128) -> Key {
        Key::with(h, wide::available())
    }

    fn with(h: u128, wide: bool) -> Key {
        let powers = wide.then(|| {
            let mut powers = [h; GROUP];
            for i in (0..GROUP - 1).rev() {
                powers[i] = times(powers[i + 1], h);
            }
            powers
        });
        Key { h, powers }
    }
}

impl Polyval {
    pub fn new(key: &Key) -> Polyval {
        let engine = match key.powers {
            Some(powers) => Engine::Wide { powers, acc: 0 },
            None => Engine::Crate(polyval::Polyval::new(&key.h.to_le_bytes().into())),
        };
        Polyval { engine, pending: [0; BLOCK], pending_len: 0 }
    }

    pub fn update(&mut self, mut bytes: &[u8]) {
        if self.pending_len > 0 {
            let take = (BLOCK - self.pending_len).min(bytes.len());
            self.pending[self.pending_len..self.pending_len + take].copy_from_slice(&bytes[..take]);
            self.pending_len += take;
            bytes = &bytes[take..];
            if self.pending_len < BLOCK {
                return;
            }
            let block = self.pending;
            self.blocks(&block);
            self.pending_len = 0;
        }
        let whole = bytes.len() / BLOCK * BLOCK;
        self.blocks(&bytes[..whole]);
        let rest = &bytes[whole..];
        self.pending[..rest.len()].copy_from_slice(rest);
        self.pending_len = rest.len();
    }

    /// The hash of everything fed, the last block padded with zeros.
    pub fn finish(mut self) -> u128 {
        if self.pending_len > 0 {
            self.pending[self.pending_len..].fill(0);
            let block = self.pending;
            self.blocks(&block);
        }
        match self.engine {
            Engine::Wide { acc, .. } => acc,
            Engine::Crate(p) => u128::from_le_bytes(p.finalize().into()),
        }
    }

    /// Whole blocks only.
    fn blocks(&mut self, blocks: &[u8]) {
        match &mut self.engine {
            // SAFETY: the wide engine is built only where `wide::available()` said so.
            Engine::Wide { powers, acc } => *acc = unsafe { wide::blocks(powers, *acc, blocks) },
            Engine::Crate(p) => p.update_padded(blocks),
        }
    }
}

/// a * b in POLYVAL's field (`dot`, RFC 8452), for the key's powers.
fn times(a: u128, b: u128) -> u128 {
    let mut p = polyval::Polyval::new(&b.to_le_bytes().into());
    p.update_padded(&a.to_le_bytes());
    u128::from_le_bytes(p.finalize().into())
}

#[cfg(target_arch = "x86_64")]
mod wide {
    use core::arch::x86_64::*;

    use super::{BLOCK, GROUP};

    pub fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("pclmulqdq") && is_x86_feature_detected!("vpclmulqdq")
    }

    /// POLYVAL's state after `bytes` (whole blocks) fed on top of `acc`.
    ///
    /// A group of blocks X1..Xn takes the state to (acc + X1)*H^n + X2*H^(n-1) + ... + Xn*H:
    /// the carry-less products are summed unreduced (the reduction is linear) and reduced once.
    /// Blocks left over go one at a time.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2, PCLMULQDQ and VPCLMULQDQ (`implementation()` checks before calling).
    #[target_feature(enable = "avx2,pclmulqdq,vpclmulqdq")]
    pub unsafe fn blocks(powers: &[u128; GROUP], acc: u128, bytes: &[u8]) -> u128 {
        debug_assert_eq!(bytes.len() % BLOCK, 0);
        // SAFETY: two u128 powers (32 bytes) from `2 * j`, inside the GROUP powers; unaligned load.
        let keys: [__m256i; GROUP / 2] = std::array::from_fn(|j| unsafe { _mm256_loadu_si256(powers[2 * j..].as_ptr().cast()) });
        // Karatsuba: each key's two halves summed, for the cross terms' one product.
        let sums: [__m256i; GROUP / 2] = keys.map(|k| _mm256_xor_si256(k, _mm256_shuffle_epi32::<0x4e>(k)));
        // SAFETY: 16 bytes of a u128 on the stack.
        let mut acc = unsafe { _mm_loadu_si128((&acc as *const u128).cast()) };
        let mut groups = bytes.chunks_exact(BLOCK * GROUP);
        for group in &mut groups {
            let at = group.as_ptr().cast::<__m256i>();
            let (mut lo, mut hi, mut mid) = (_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256());
            for (j, (key, sum)) in keys.iter().zip(&sums).enumerate() {
                // SAFETY: 32 bytes at `j * 32` of a group of `GROUP * BLOCK` bytes (j < GROUP / 2).
                let mut x = unsafe { _mm256_loadu_si256(at.add(j)) };
                if j == 0 {
                    x = _mm256_xor_si256(x, _mm256_zextsi128_si256(acc));
                }
                lo = _mm256_xor_si256(lo, _mm256_clmulepi64_epi128(x, *key, 0x00));
                hi = _mm256_xor_si256(hi, _mm256_clmulepi64_epi128(x, *key, 0x11));
                let x_sum = _mm256_xor_si256(x, _mm256_shuffle_epi32::<0x4e>(x));
                mid = _mm256_xor_si256(mid, _mm256_clmulepi64_epi128(x_sum, *sum, 0x00));
            }
            // (x0 + x1)(k0 + k1) = x0k0 + x1k1 + the cross terms.
            let mid = _mm256_xor_si256(mid, _mm256_xor_si256(lo, hi));
            acc = reduce(fold(lo), fold(hi), fold(mid));
        }
        // SAFETY: 16 bytes of a u128 of `powers`.
        let h = unsafe { _mm_loadu_si128((&powers[GROUP - 1] as *const u128).cast()) };
        for block in groups.remainder().chunks_exact(BLOCK) {
            // SAFETY: a block is 16 bytes (`chunks_exact(BLOCK)`).
            let x = _mm_xor_si128(acc, unsafe { _mm_loadu_si128(block.as_ptr().cast()) });
            let mid = _mm_xor_si128(_mm_clmulepi64_si128(x, h, 0x01), _mm_clmulepi64_si128(x, h, 0x10));
            acc = reduce(_mm_clmulepi64_si128(x, h, 0x00), _mm_clmulepi64_si128(x, h, 0x11), mid);
        }
        let mut out = 0u128;
        // SAFETY: 16 bytes into a u128 on the stack.
        unsafe { _mm_storeu_si128((&mut out as *mut u128).cast(), acc) };
        out
    }

    /// The sum of a register's two 128-bit lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn fold(v: __m256i) -> __m128i {
        _mm_xor_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v))
    }

    /// The 256-bit product `hi:lo` (with the cross terms `mid` still apart) times x^-128,
    /// modulo POLYVAL's polynomial: two folds by its low terms (Gueron's Montgomery reduction,
    /// as in AES-GCM-SIV).
    #[inline]
    #[target_feature(enable = "pclmulqdq,sse2")]
    fn reduce(lo: __m128i, hi: __m128i, mid: __m128i) -> __m128i {
        let lo = _mm_xor_si128(lo, _mm_slli_si128::<8>(mid));
        let hi = _mm_xor_si128(hi, _mm_srli_si128::<8>(mid));
        let poly = _mm_set_epi64x(0xc200_0000_0000_0000_u64 as i64, 1);
        let lo = _mm_xor_si128(_mm_shuffle_epi32::<0x4e>(lo), _mm_clmulepi64_si128(lo, poly, 0x10));
        let lo = _mm_xor_si128(_mm_shuffle_epi32::<0x4e>(lo), _mm_clmulepi64_si128(lo, poly, 0x10));
        _mm_xor_si128(hi, lo)
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod wide {
    pub fn available() -> bool {
        false
    }

    /// # Safety
    ///
    /// Never called: `available()` is false off x86-64.
    pub unsafe fn blocks(_: &[u128; super::GROUP], _: u128, _: &[u8]) -> u128 {
        unreachable!("never built without VPCLMULQDQ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn rfc_8452_test_vector() {
        // RFC 8452, Appendix A: POLYVAL(H, X_1, X_2).
        let h = u128::from_le_bytes(*b"\x25\x62\x93\x47\x58\x92\x42\x76\x1d\x31\xf8\x26\xba\x4b\x75\x7b");
        let x = b"\x4f\x4f\x95\x66\x8c\x83\xdf\xb6\x40\x17\x62\xbb\x2d\x01\xa2\x62\xd1\xa2\x4d\xdd\x27\x21\xd0\x06\xbb\xe4\x5f\x20\xd3\xc9\xf3\x62";
        let want = u128::from_le_bytes(*b"\xf7\xa3\xb4\x7b\x84\x61\x19\xfa\xe5\xb7\x86\x6c\xf5\xe5\xb7\x7e");
        for wide in [false, wide::available()] {
            let mut p = Polyval::new(&Key::with(h, wide));
            p.update(x);
            assert_eq!(p.finish(), want, "wide {wide}");
        }
    }

    #[test]
    fn the_wide_path_equals_the_crate_at_every_length_and_split() {
        if !wide::available() {
            eprintln!("this CPU has no VPCLMULQDQ: only the crate's path runs here");
            return;
        }
        for (seed, len) in [0usize, 1, 15, 16, 17, 127, 128, 129, 255, 256, 1000, 4096, 8192 + 48, 65_536 + 3].into_iter().enumerate() {
            let data = bytes(len, seed as u64);
            let h = u128::from_le_bytes(bytes(16, 1000 + seed as u64).try_into().unwrap());
            let whole = |wide| {
                let mut p = Polyval::new(&Key::with(h, wide));
                p.update(&data);
                p.finish()
            };
            let want = whole(false);
            assert_eq!(whole(true), want, "length {len}");
            // Fed in uneven pieces, as a page arrives off a socket.
            let mut p = Polyval::new(&Key::with(h, true));
            for piece in data.chunks(37 + seed) {
                p.update(piece);
            }
            assert_eq!(p.finish(), want, "length {len} in pieces");
        }
    }
}
