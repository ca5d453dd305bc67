//! The pieces of an online softmax over a row of scores: its maximum, and `e^(x - max)` in place
//! with the row's sum. Sixteen independent lanes (one AVX-512 vector, two AVX2 ones) so the
//! reductions vectorize; the sum's order is the lanes', the same at every level.

use super::lanes::{LANES, reduce};
use super::level::multiversion;

multiversion! {
    /// The largest score of `x` (`-inf` for an empty row).
    pub fn row_max / row_max_at(x: &[f32]) -> f32 => row_max_body
}

multiversion! {
    /// Replaces every score `s` of `x` by `e^(s - shift)` and returns their sum.
    pub fn exp_sum / exp_sum_at(x: &mut [f32], shift: f32) -> f32 => exp_sum_body
}

/// `row_max` for a caller already compiled for a level (a kernel inlines it).
#[inline(always)]
pub(crate) fn row_max_body(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            lanes[l] = if c[l] > lanes[l] { c[l] } else { lanes[l] };
        }
    }
    tail.iter().chain(&lanes).copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `exp_sum` for a caller already compiled for a level.
#[inline(always)]
pub(crate) fn exp_sum_body(x: &mut [f32], shift: f32) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let mut chunks = x.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            c[l] = exp(c[l] - shift);
            lanes[l] += c[l];
        }
    }
    let mut tail = 0.0;
    for s in chunks.into_remainder() {
        *s = exp(*s - shift);
        tail += *s;
    }
    reduce(lanes) + tail
}

/// `e^x` for the softmax's `x <= 0` (and -inf), in plain arithmetic that vectorizes:
/// `x = n ln 2 + r`, `e^r` by its degree-6 Taylor polynomial on `|r| <= ln 2 / 2` (relative error
/// below 2e-7), scaled by `2^n` built in the exponent bits with integer arithmetic.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it leaves round(y) in the low bits
    let x = x.max(-87.0);
    let t = x * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6; // ln 2 split in two for precision
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // n + 127 (in 1..=127 for x >= -87) sits in t's low mantissa bits; shifted into the exponent.
    p * f32::from_bits(t.to_bits().wrapping_add(127) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::level::Level;

    #[test]
    fn the_softmax_exponential_is_within_a_few_ulps() {
        for i in 0..=8700 {
            let x = -(i as f32) / 100.0;
            let (got, want) = (exp(x), (x as f64).exp());
            assert!(((got as f64 - want) / want).abs() < 5e-7, "exp({x}) = {got}, want {want}");
        }
        assert!(exp(f32::NEG_INFINITY) < 1e-37, "a masked score weighs nothing");
    }

    #[test]
    fn max_and_exp_sum_match_a_plain_loop_at_every_length() {
        for n in [0usize, 1, 7, 16, 17, 100, 256] {
            let row: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(row_max(&row), max, "length {n}");
            let mut got = row.clone();
            let sum = exp_sum(&mut got, max);
            let want: Vec<f64> = row.iter().map(|&s| ((s - max) as f64).exp()).collect();
            for (g, w) in got.iter().zip(&want) {
                assert!(((*g as f64 - w) / w).abs() < 5e-7, "length {n}: {g} vs {w}");
            }
            let total: f64 = want.iter().sum();
            assert!(n == 0 || ((sum as f64 - total) / total).abs() < 1e-6, "length {n}: sum {sum} vs {total}");
        }
    }

    #[test]
    fn every_level_the_cpu_offers_gives_the_same_bits() {
        let row: Vec<f32> = (0..300).map(|i| ((i * 53 % 211) as f32 - 100.0) / 9.0).collect();
        let run = |level| {
            let mut r = row.clone();
            let sum = exp_sum_at(level, &mut r, 3.0);
            (row_max_at(level, &row).to_bits(), sum.to_bits(), r.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
        };
        let want = run(Level::Portable);
        for level in Level::available() {
            assert_eq!(run(level), want, "{level:?} differs from portable");
        }
    }
}
