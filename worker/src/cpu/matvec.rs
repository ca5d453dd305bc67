//! Products of a few rows against a weight matrix, `y = x W^T (+ b)` with `x` `[m][k]` and `W`
//! `[n][k]` as checkpoints store it: what a decode step is. General matrix-multiply kernels pack
//! `W` into tiles on every call, which costs as much as the product when `x` has one row; here
//! each row of `W` is streamed once from memory and dotted with every row of `x` while it sits in
//! L1. The rows of `W` are split across the compute threads. Half-precision weights (f16, bf16)
//! are converted in registers as they are loaded (`half_rows`; without AVX2, widened 16 rows at
//! a time into a buffer that stays in cache and sent through the f32 kernel): memory moves their
//! stored bytes only, and every sum is the one the widened f32 weight would give, bit for bit.

use std::cell::RefCell;
use std::ops::Range;

use rayon::prelude::*;

use super::lanes::{LANES, dot, reduce};
use super::level::multiversion;
use super::widen::HalfFloat;

/// Up to this many rows of `x` go through here; more are a matrix product for `gemm` (measured
/// on the bench model: at 16 rows this is still 1.2x faster with weights streamed from memory).
/// Half-precision weights stream further (`projection::HALF_STREAMED_ROWS`): their product
/// would first widen the weight.
pub const MAX_ROWS: usize = 16;

/// Rows of a weight in the type the checkpoint stores them.
pub trait WeightRows: Sync {
    /// Elements (rows times `k`).
    fn elements(&self) -> usize;
    /// `out[j][i] = w_j . x_i` for the rows `w_j`, `j` in `rows`.
    fn dot_rows(&self, x: &[f32], rows: Range<usize>, k: usize, out: &mut [f32]);
}

impl WeightRows for [f32] {
    fn elements(&self) -> usize {
        self.len()
    }

    fn dot_rows(&self, x: &[f32], rows: Range<usize>, k: usize, out: &mut [f32]) {
        rows_of(x, &self[rows.start * k..rows.end * k], k, out);
    }
}

/// Rows widened at a time: 16 rows of 4,096 inputs are 256 KiB, in L2.
const WIDEN_ROWS: usize = 16;

impl<T: HalfFloat> WeightRows for [T] {
    fn elements(&self) -> usize {
        self.len()
    }

    /// Converted in registers where the level has a kernel for it (`half_rows`); else through
    /// each thread's buffer of widened rows (reused: a decode step calls this hundreds of times).
    fn dot_rows(&self, x: &[f32], rows: Range<usize>, k: usize, out: &mut [f32]) {
        if super::half_rows::rows_of(x, &self[rows.start * k..rows.end * k], k, out) {
            return;
        }
        thread_local! {
            static BUFFER: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        }
        let m = x.len() / k;
        BUFFER.with_borrow_mut(|buf| {
            for start in rows.clone().step_by(WIDEN_ROWS) {
                let end = (start + WIDEN_ROWS).min(rows.end);
                buf.resize((end - start) * k, 0.0);
                T::widen(&self[start * k..end * k], buf);
                rows_of(x, buf, k, &mut out[(start - rows.start) * m..(end - rows.start) * m]);
            }
        });
    }
}

/// `x` `[m][k]`, `w` `[n][k]`, `bias` `[n]`: returns `[m][n]`.
pub fn skinny<W: WeightRows + ?Sized>(x: &[f32], w: &W, bias: Option<&[f32]>, k: usize) -> Vec<f32> {
    let (m, n) = (x.len() / k, w.elements() / k);
    assert!(x.len() == m * k && w.elements() == n * k && bias.is_none_or(|b| b.len() == n), "shapes: x {} w {} k {k}", x.len(), w.elements());
    // Tasks of whole rows of W, a few per thread so uneven threads even out.
    let per_task = n.div_ceil(rayon::current_num_threads() * 4).next_multiple_of(4).max(16);
    let mut transposed = vec![0.0f32; n * m]; // [n][m]: each task's output is one run
    transposed.par_chunks_mut(per_task * m).enumerate().for_each(|(t, out)| {
        let rows = t * per_task..t * per_task + out.len() / m;
        w.dot_rows(x, rows, k, out);
    });
    let mut y = vec![0.0f32; m * n];
    for (j, col) in transposed.chunks_exact(m).enumerate() {
        let b = bias.map_or(0.0, |b| b[j]);
        for (i, v) in col.iter().enumerate() {
            y[i * n + j] = v + b;
        }
    }
    y
}

multiversion! {
    /// `out[j][i] = w_j . x_i` for the rows `w_j` of `w`.
    fn rows_of / rows_of_at(x: &[f32], w: &[f32], k: usize, out: &mut [f32]) => rows_of_body
}

#[inline(always)]
fn rows_of_body(x: &[f32], w: &[f32], k: usize, out: &mut [f32]) {
    let m = x.len() / k;
    let quads = m / 4 * 4;
    // Four rows of w at a time: each loaded chunk of one operand feeds four products.
    let mut w_quads = w.chunks_exact(4 * k);
    let mut o_quads = out.chunks_exact_mut(4 * m);
    for (wq, o) in (&mut w_quads).zip(&mut o_quads) {
        for (j, wj) in wq.chunks_exact(k).enumerate() {
            for (xq, o) in x[..quads * k].chunks_exact(4 * k).zip(o[j * m..j * m + quads].chunks_exact_mut(4)) {
                o.copy_from_slice(&dot4(wj, xq));
            }
        }
        for i in quads..m {
            for (j, v) in dot4(&x[i * k..(i + 1) * k], wq).into_iter().enumerate() {
                o[j * m + i] = v;
            }
        }
    }
    for (wj, o) in w_quads.remainder().chunks_exact(k).zip(o_quads.into_remainder().chunks_exact_mut(m)) {
        for (xi, o) in x.chunks_exact(k).zip(o) {
            *o = dot(wj, xi);
        }
    }
}

/// `a` dotted with each of the four rows of `b` (`[4][a.len()]`), every product summed exactly
/// as `dot` sums it (products commute), so a result does not depend on which operand shared
/// the pass.
#[inline(always)]
fn dot4(a: &[f32], b: &[f32]) -> [f32; 4] {
    let k = a.len();
    let (b0, b1, b2, b3) = (&b[..k], &b[k..2 * k], &b[2 * k..3 * k], &b[3 * k..4 * k]);
    let mut lanes = [[0.0f32; LANES]; 4];
    let chunks = a.chunks_exact(LANES).zip(b0.chunks_exact(LANES)).zip(b1.chunks_exact(LANES)).zip(b2.chunks_exact(LANES)).zip(b3.chunks_exact(LANES));
    for ((((x, y0), y1), y2), y3) in chunks {
        for l in 0..LANES {
            lanes[0][l] += x[l] * y0[l];
            lanes[1][l] += x[l] * y1[l];
            lanes[2][l] += x[l] * y2[l];
            lanes[3][l] += x[l] * y3[l];
        }
    }
    let whole = k / LANES * LANES;
    let tail = |y: &[f32]| -> f32 { a[whole..].iter().zip(&y[whole..]).map(|(x, y)| x * y).sum() };
    let [l0, l1, l2, l3] = lanes;
    [reduce(l0) + tail(b0), reduce(l1) + tail(b1), reduce(l2) + tail(b2), reduce(l3) + tail(b3)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Level;
    use crate::test_data::pseudo;
    use half::{bf16, f16};

    #[test]
    fn equals_the_product_in_f64_with_and_without_bias() {
        for (m, n, k) in [(1usize, 1usize, 1usize), (1, 300, 512), (3, 77, 37), (8, 1000, 64)] {
            let (x, w, b) = (pseudo(m * k, 1), pseudo(n * k, 2), pseudo(n, 3));
            for bias in [None, Some(&b[..])] {
                let y = skinny(&x, &w[..], bias, k);
                for i in 0..m {
                    for j in 0..n {
                        let want = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum::<f64>() + bias.map_or(0.0, |b| b[j] as f64);
                        assert!((y[i * n + j] as f64 - want).abs() < 1e-4, "({m},{n},{k}) [{i}][{j}]: {} vs {want}", y[i * n + j]);
                    }
                }
            }
        }
    }

    /// A sequence's outputs do not depend on what else is in the step.
    #[test]
    fn a_row_gives_the_same_bits_alone_and_in_any_batch() {
        let (n, k) = (90, 70);
        let (x, w) = (pseudo(8 * k, 6), pseudo(n * k, 7));
        for m in 1..=8 {
            let batch = skinny(&x[..m * k], &w[..], None, k);
            for i in 0..m {
                let alone = skinny(&x[i * k..(i + 1) * k], &w[..], None, k);
                assert!(alone.iter().zip(&batch[i * n..(i + 1) * n]).all(|(a, b)| a.to_bits() == b.to_bits()), "row {i} of {m}");
            }
        }
    }

    /// Half-precision weights give the bits their widened f32 copy gives.
    #[test]
    fn half_weights_give_the_bits_of_their_widened_copy() {
        for (m, n, k) in [(1usize, 1usize, 1usize), (1, 300, 512), (3, 77, 37), (16, 40, 200), (33, 21, 64)] {
            let (x, w) = (pseudo(m * k, 8), pseudo(n * k, 9));
            let b = pseudo(n, 10);
            let halves: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            let brains: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let bits = |y: Vec<f32>| y.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let wide_h: Vec<f32> = halves.iter().map(|v| v.to_f32()).collect();
            let wide_b: Vec<f32> = brains.iter().map(|v| v.to_f32()).collect();
            assert_eq!(bits(skinny(&x, &halves[..], Some(&b), k)), bits(skinny(&x, &wide_h[..], Some(&b), k)), "f16 ({m},{n},{k})");
            assert_eq!(bits(skinny(&x, &brains[..], None, k)), bits(skinny(&x, &wide_b[..], None, k)), "bf16 ({m},{n},{k})");
        }
    }

    #[test]
    fn every_level_the_cpu_offers_gives_the_same_bits() {
        let (m, n, k) = (5, 40, 200);
        let (x, w) = (pseudo(m * k, 4), pseudo(n * k, 5));
        let run = |level| {
            let mut out = vec![0.0f32; n * m];
            rows_of_at(level, &x, &w, k, &mut out);
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let want = run(Level::Portable);
        for level in Level::available() {
            assert_eq!(run(level), want, "{level:?} differs from portable");
        }
    }
}
