//! A Llama MLP's gated activation, `silu(gate) * up`, in one pass over the stacked projection's
//! rows (`[gate | up]`): candle's `silu` on the strided gate half, then a product, took three
//! passes and two allocations (5-7% of a 512-token prefill).

use rayon::prelude::*;

use super::level::multiversion;
use super::softmax;

/// Rows per unit of parallel work.
const ROWS: usize = 16;

/// `out[r][i] = silu(y[r][i]) * y[r][width + i]` for `y`'s rows of `2 * width`, split across the
/// compute threads when there is more than one unit of work (a decode step's few rows stay on
/// the calling thread: handing them to the pool costs more than they do).
pub fn silu_mul(y: &[f32], width: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; y.len() / 2];
    if out.len() <= ROWS * width {
        rows(y, width, &mut out);
    } else {
        out.par_chunks_mut(ROWS * width).zip(y.par_chunks(ROWS * 2 * width)).for_each(|(o, y)| rows(y, width, o));
    }
    out
}

multiversion! {
    /// `silu_mul` of a few rows on the calling thread, into `out`.
    pub fn rows / rows_at(y: &[f32], width: usize, out: &mut [f32]) => rows_body
}

#[inline(always)]
fn rows_body(y: &[f32], width: usize, out: &mut [f32]) {
    for (row, o) in y.chunks_exact(2 * width).zip(out.chunks_exact_mut(width)) {
        let (gate, up) = row.split_at(width);
        for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
            *o = silu(g) * u;
        }
    }
}

/// `x * sigmoid(x)`, from `e^-|x|` (which never overflows): `1 / (1 + e^-x)` for `x >= 0`,
/// `e^x / (1 + e^x)` below.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    let e = softmax::exp(-x.abs());
    let top = if x >= 0.0 { 1.0 } else { e };
    x * (top / (1.0 + e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::level::Level;
    use crate::test_data::pseudo;

    #[test]
    fn silu_is_within_a_few_ulps_of_the_definition() {
        // Down to -87, where the exponential's range ends (below it silu is under 1e-36).
        for i in -8700..=9000 {
            let x = i as f32 / 100.0;
            let want = x as f64 / (1.0 + (-(x as f64)).exp());
            let got = silu(x) as f64;
            assert!((got - want).abs() <= 1e-6 * want.abs() + 1e-37, "silu({x}) = {got}, want {want}");
        }
        assert_eq!(silu(0.0), 0.0);
        assert!(silu(-200.0) <= 0.0 && silu(-200.0) > -1e-35);
    }

    #[test]
    fn every_level_gives_the_bits_of_the_parallel_kernel() {
        let width = 37;
        let y: Vec<f32> = pseudo(45 * 2 * width, 5).iter().map(|x| x * 20.0).collect();
        let got = silu_mul(&y, width);
        for level in Level::available() {
            let mut out = vec![0.0; got.len()];
            rows_at(level, &y, width, &mut out);
            assert_eq!(out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "{level:?}");
        }
        for (r, row) in y.chunks(2 * width).enumerate() {
            for i in 0..width {
                assert_eq!(got[r * width + i], silu(row[i]) * row[width + i]);
            }
        }
    }
}
