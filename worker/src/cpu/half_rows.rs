//! Dot products of f32 rows with half-precision weight rows, each weight converted to f32 in a
//! register as it is loaded (F16C's `vcvtph2ps` for f16, a 16-bit shift for bf16): a decode step
//! over a half weight moves its 2 bytes a weight and writes nothing back. Every sum is the one
//! `lanes::dot` makes of the widened row (16 lanes, a multiply then an add, the same pairwise
//! reduction, the tail added last), so the bits are the widened weight's at every level.

use super::level::Level;
use super::widen::HalfFloat;

/// `out[j][i] = w_j . x_i` for the rows `w_j` of `w` and `x_i` of `x` (`k` inputs each), at the
/// chosen level; `false` (nothing written) where the level has no such kernel.
pub fn rows_of<H: HalfFloat>(x: &[f32], w: &[H], k: usize, out: &mut [f32]) -> bool {
    rows_of_at(super::level(), x, w, k, out)
}

pub(crate) fn rows_of_at<H: HalfFloat>(level: Level, x: &[f32], w: &[H], k: usize, out: &mut [f32]) -> bool {
    assert!(level <= super::level::widest(), "{level:?} is wider than this CPU");
    assert!(x.len().is_multiple_of(k) && w.len().is_multiple_of(k) && out.len() == x.len() / k * (w.len() / k), "shapes: x {} w {} k {k}", x.len(), w.len());
    #[cfg(target_arch = "x86_64")]
    {
        match level {
            // SAFETY: the CPU has the level's features (asserted above; `widest` checks F16C
            // too), and the shapes were asserted as the kernels need them.
            Level::Avx512 => unsafe { x86::rows_avx512(x, w, k, out) },
            // SAFETY: as above.
            Level::Avx2 => unsafe { x86::rows_avx2(x, w, k, out) },
            Level::Portable => return false,
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (x, w, out);
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::lanes::{LANES, reduce};
    use super::super::widen::HalfFloat;

    /// How far ahead (in weights) each weight row is prefetched. The hardware prefetcher alone
    /// kept four rows per thread streaming below what memory gives: with this, one f16 decode
    /// stream ran 15 % faster and eight 24 % (gguf bench model, by hand; 256 and 2,048 gained
    /// less).
    const PREFETCH_AHEAD: usize = 512;

    /// Sixteen lanes in the level's registers.
    ///
    /// # Safety
    ///
    /// Every method needs the CPU features of the implementing level (the kernels that call them
    /// are compiled with those features and entered only on such a CPU); `load` reads sixteen
    /// f32 at `p` and `load_half` sixteen halves, which must be in bounds.
    trait Lanes16: Copy {
        unsafe fn zero() -> Self;
        unsafe fn load(p: *const f32) -> Self;
        unsafe fn load_half<H: HalfFloat>(p: *const H) -> Self;
        /// `self + a * b`, rounded after the multiply and after the add (no fused multiply-add).
        unsafe fn mul_add(self, a: Self, b: Self) -> Self;
        unsafe fn store(self) -> [f32; LANES];
    }

    #[derive(Clone, Copy)]
    struct Zmm(__m512);

    impl Lanes16 for Zmm {
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: AVX-512F, the trait's contract.
            Zmm(unsafe { _mm512_setzero_ps() })
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: sixteen f32 at `p` (the caller's bounds); AVX-512F.
            Zmm(unsafe { _mm512_loadu_ps(p) })
        }
        #[inline(always)]
        unsafe fn load_half<H: HalfFloat>(p: *const H) -> Self {
            // SAFETY: sixteen halves (32 bytes) at `p` (the caller's bounds), unaligned load.
            let raw = unsafe { _mm256_loadu_si256(p as *const __m256i) };
            // SAFETY: register arithmetic only; AVX-512F and F16C.
            Zmm(unsafe { if H::IS_F16 { _mm512_cvtph_ps(raw) } else { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw))) } })
        }
        #[inline(always)]
        unsafe fn mul_add(self, a: Self, b: Self) -> Self {
            // SAFETY: register arithmetic only; AVX-512F.
            Zmm(unsafe { _mm512_add_ps(self.0, _mm512_mul_ps(a.0, b.0)) })
        }
        #[inline(always)]
        unsafe fn store(self) -> [f32; LANES] {
            let mut out = [0.0; LANES];
            // SAFETY: `out` holds sixteen f32; AVX-512F.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr(), self.0) };
            out
        }
    }

    /// Lanes 0..8 and 8..16 in two AVX registers.
    #[derive(Clone, Copy)]
    struct Ymm2(__m256, __m256);

    impl Lanes16 for Ymm2 {
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: AVX, the trait's contract.
            unsafe { Ymm2(_mm256_setzero_ps(), _mm256_setzero_ps()) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: sixteen f32 at `p` (the caller's bounds); AVX.
            unsafe { Ymm2(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) }
        }
        #[inline(always)]
        unsafe fn load_half<H: HalfFloat>(p: *const H) -> Self {
            let eight = |p: *const H| {
                // SAFETY: eight halves at `p` (the caller's bounds); the level's features.
                unsafe {
                    let raw = _mm_loadu_si128(p as *const __m128i);
                    if H::IS_F16 { _mm256_cvtph_ps(raw) } else { _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw))) }
                }
            };
            // SAFETY: sixteen halves at `p` (the caller's bounds), eight at a time.
            unsafe { Ymm2(eight(p), eight(p.add(8))) }
        }
        #[inline(always)]
        unsafe fn mul_add(self, a: Self, b: Self) -> Self {
            // SAFETY: register arithmetic only; AVX.
            unsafe { Ymm2(_mm256_add_ps(self.0, _mm256_mul_ps(a.0, b.0)), _mm256_add_ps(self.1, _mm256_mul_ps(a.1, b.1))) }
        }
        #[inline(always)]
        unsafe fn store(self) -> [f32; LANES] {
            let mut out = [0.0; LANES];
            // SAFETY: `out` holds sixteen f32, written eight at a time; AVX.
            unsafe {
                _mm256_storeu_ps(out.as_mut_ptr(), self.0);
                _mm256_storeu_ps(out.as_mut_ptr().add(8), self.1);
            }
            out
        }
    }

    /// `rows_of` with AVX-512 registers.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F, AVX2, FMA and F16C; `x` and `w` hold whole rows of `k` and `out`
    /// holds `x.len() / k * (w.len() / k)` sums (what `rows_of_at` asserts).
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn rows_avx512<H: HalfFloat>(x: &[f32], w: &[H], k: usize, out: &mut [f32]) {
        // SAFETY: the features are enabled here and the shapes are the caller's contract.
        unsafe { rows::<Zmm, H, 4>(x, w, k, out) }
    }

    /// `rows_of` with AVX2 registers.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2, FMA and F16C; the shapes as for `rows_avx512`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows_avx2<H: HalfFloat>(x: &[f32], w: &[H], k: usize, out: &mut [f32]) {
        // Sixteen registers: four weight rows against two of x fill eight pairs with sums.
        // SAFETY: the features are enabled here and the shapes are the caller's contract.
        unsafe { rows::<Ymm2, H, 2>(x, w, k, out) }
    }

    /// Tiles of four weight rows (then one at a time) against up to `XR` rows of `x`: each
    /// loaded chunk of either operand feeds several sums.
    ///
    /// # Safety
    ///
    /// `V`'s CPU features; whole rows of `k` in `x` and `w`, room in `out` for every sum.
    #[inline(always)]
    unsafe fn rows<V: Lanes16, H: HalfFloat, const XR: usize>(x: &[f32], w: &[H], k: usize, out: &mut [f32]) {
        let (m, n) = (x.len() / k, w.len() / k);
        let mut j = 0;
        while j < n {
            let wr = if n - j >= 4 { 4 } else { 1 };
            let mut i = 0;
            while i < m {
                let xr = (m - i).min(XR);
                let mut sums = [[0.0f32; 4]; 4];
                // SAFETY: rows `i..i + xr` of x and `j..j + wr` of w exist (the loops' bounds).
                unsafe {
                    match (wr, xr) {
                        (4, 4) => tile::<V, H, 4, 4>(x, w, k, i, j, &mut sums),
                        (4, 3) => tile::<V, H, 4, 3>(x, w, k, i, j, &mut sums),
                        (4, 2) => tile::<V, H, 4, 2>(x, w, k, i, j, &mut sums),
                        (4, _) => tile::<V, H, 4, 1>(x, w, k, i, j, &mut sums),
                        (_, 4) => tile::<V, H, 1, 4>(x, w, k, i, j, &mut sums),
                        (_, 3) => tile::<V, H, 1, 3>(x, w, k, i, j, &mut sums),
                        (_, 2) => tile::<V, H, 1, 2>(x, w, k, i, j, &mut sums),
                        _ => tile::<V, H, 1, 1>(x, w, k, i, j, &mut sums),
                    }
                }
                for (r, row) in sums.iter().enumerate().take(wr) {
                    out[(j + r) * m + i..(j + r) * m + i + xr].copy_from_slice(&row[..xr]);
                }
                i += xr;
            }
            j += wr;
        }
    }

    /// `sums[r][c] = w_{j+r} . x_{i+c}`.
    ///
    /// # Safety
    ///
    /// `V`'s CPU features; rows `i..i + XR` of `x` and `j..j + WR` of `w` exist.
    #[inline(always)]
    unsafe fn tile<V: Lanes16, H: HalfFloat, const WR: usize, const XR: usize>(x: &[f32], w: &[H], k: usize, i: usize, j: usize, sums: &mut [[f32; 4]; 4]) {
        let whole = k / LANES * LANES;
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        // SAFETY: `V`'s features are the caller's contract.
        let mut acc = [[unsafe { V::zero() }; XR]; WR];
        let mut at = 0;
        while at < whole {
            // SAFETY: `at + LANES <= k` inside rows `i..i + XR` of x and `j..j + WR` of w.
            unsafe {
                let xs: [V; XR] = std::array::from_fn(|c| V::load(xp.add((i + c) * k + at)));
                for (r, acc) in acc.iter_mut().enumerate() {
                    if at % (64 / size_of::<H>()) == 0 {
                        // One cache line of each weight row, a kilobyte ahead (a hint: never faults).
                        _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add((j + r) * k + at + PREFETCH_AHEAD) as *const i8);
                    }
                    let wv = V::load_half(wp.add((j + r) * k + at));
                    for c in 0..XR {
                        acc[c] = acc[c].mul_add(xs[c], wv);
                    }
                }
            }
            at += LANES;
        }
        for r in 0..WR {
            let wr = &w[(j + r) * k + whole..(j + r + 1) * k];
            for c in 0..XR {
                let xr = &x[(i + c) * k + whole..(i + c + 1) * k];
                let tail: f32 = xr.iter().zip(wr).map(|(a, b)| a * b.to_f32()).sum();
                // SAFETY: `V`'s features are the caller's contract.
                sums[r][c] = reduce(unsafe { acc[r][c].store() }) + tail;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_data::pseudo;
    use half::{bf16, f16};

    /// At every level the CPU offers, the bits of `lanes::dot` on the widened rows, whatever the
    /// row counts (tiles of 4 and the rows left over) and the tail after the last 16 inputs.
    #[test]
    fn every_level_gives_the_bits_of_the_widened_dot() {
        for (m, n, k) in [(1usize, 1usize, 1usize), (1, 9, 16), (3, 7, 37), (5, 13, 200), (16, 12, 64), (2, 4, 15)] {
            let (x, w) = (pseudo(m * k, 11), pseudo(n * k, 12));
            let halves: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            let brains: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let want = |wide: Vec<f32>| -> Vec<u32> {
                (0..n)
                    .flat_map(|j| (0..m).map(move |i| (i, j)))
                    .map(|(i, j)| super::super::lanes::dot(&wide[j * k..(j + 1) * k], &x[i * k..(i + 1) * k]).to_bits())
                    .collect()
            };
            let (want_h, want_b) = (want(halves.iter().map(|v| v.to_f32()).collect()), want(brains.iter().map(|v| v.to_f32()).collect()));
            for level in Level::available() {
                let mut out = vec![f32::NAN; n * m];
                if rows_of_at(level, &x, &halves, k, &mut out) {
                    assert_eq!(out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want_h, "f16 {level:?} ({m},{n},{k})");
                    assert!(rows_of_at(level, &x, &brains, k, &mut out));
                    assert_eq!(out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want_b, "bf16 {level:?} ({m},{n},{k})");
                } else {
                    assert_eq!(level, Level::Portable, "only the portable level widens into a buffer instead");
                }
            }
        }
    }
}
