//! Attention of one query token over K/V read block by block, with an online softmax.
//!
//! A block is a run of token slots `[slot][kv_head][head_dim]` for K and the same for V: one page
//! of one layer when reading the paged pool, or any run of a contiguous cache. Reading blocks
//! means the kernel never needs the sequence's KV gathered into one buffer.

use std::ops::Range;

use super::KvDtype;
use super::element;
use crate::cpu::lanes::dot;
use crate::cpu::level::multiversion;
use crate::cpu::softmax;

/// Head geometry of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}

/// Per-call buffers, reused across calls to avoid allocating in the hot loop.
#[derive(Debug, Default)]
pub struct Scratch {
    running: Running,
    /// A block's K and V decoded to f32 when the pool stores another type.
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Each head's running softmax maximum and sum, and one block's scores.
#[derive(Debug, Default)]
pub(crate) struct Running {
    max: Vec<f32>,
    sum: Vec<f32>,
    scores: Vec<f32>,
}

/// `out[h] = softmax(q[h] . K^T / sqrt(d)) V` over all blocks, for every query head `h` of the
/// K/V heads `kv_heads`.
///
/// `q` and `out` are `[heads][head_dim]` for those query heads only (the group of each K/V head
/// in turn), so that disjoint K/V heads of one token can be attended on different threads; each
/// head's result is the same whichever range it is computed in. Query heads share K/V heads in
/// groups (grouped-query attention). Blocks are bytes stored as `dtype`, decoded to f32 a block
/// at a time; each runs through `block`, compiled per CPU level.
pub fn attend<'a>(
    shape: AttnShape,
    kv_heads: Range<usize>,
    q: &[f32],
    dtype: KvDtype,
    blocks: impl Iterator<Item = (&'a [u8], &'a [u8], usize)>,
    out: &mut [f32],
    scratch: &mut Scratch,
) {
    let (h_n, d) = (kv_heads.len() * shape.group(), shape.head_dim);
    let Scratch { running, k: k_buf, v: v_buf } = scratch;
    running.max.clear();
    running.max.resize(h_n, f32::NEG_INFINITY);
    running.sum.clear();
    running.sum.resize(h_n, 0.0);
    out[..h_n * d].fill(0.0);
    for (k, v, n) in blocks {
        let (k, v) = (element::decode(dtype, k, k_buf), element::decode(dtype, v, v_buf));
        debug_assert_eq!(k.len(), n * shape.num_kv_heads * shape.head_dim);
        block(shape, kv_heads.start, q, k, v, out, running);
    }
    for h in 0..h_n {
        let inv = 1.0 / running.sum[h];
        out[h * d..(h + 1) * d].iter_mut().for_each(|a| *a *= inv);
    }
}

multiversion! {
    /// One block of tokens (`k`, `v`: `[token][kv_head][head_dim]`) folded into each head's
    /// running softmax and output; `q`, `out` and `running` hold the query heads of the K/V heads
    /// from `first_kv_head` on.
    fn block / block_at(shape: AttnShape, first_kv_head: usize, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32], running: &mut Running) => block_body
}

#[inline(always)]
fn block_body(shape: AttnShape, first_kv_head: usize, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32], running: &mut Running) {
    let (kv_n, d) = (shape.num_kv_heads, shape.head_dim);
    let h_n = running.max.len();
    let n = k.len() / (kv_n * d);
    let group = shape.group();
    let scale = 1.0 / (d as f32).sqrt();
    if running.scores.len() < n {
        running.scores.resize(n, 0.0);
    }
    for h in 0..h_n {
        let g = first_kv_head + h / group;
        let qh = &q[h * d..(h + 1) * d];
        let scores = &mut running.scores[..n];
        for (t, s) in scores.iter_mut().enumerate() {
            *s = dot(qh, &k[(t * kv_n + g) * d..(t * kv_n + g + 1) * d]) * scale;
        }
        let old_max = running.max[h];
        let new_max = old_max.max(softmax::row_max_body(scores));
        let acc = &mut out[h * d..(h + 1) * d];
        if old_max != f32::NEG_INFINITY && old_max != new_max {
            let correction = softmax::exp(old_max - new_max);
            running.sum[h] *= correction;
            acc.iter_mut().for_each(|a| *a *= correction);
        }
        running.sum[h] += softmax::exp_sum_body(scores, new_max);
        for (t, &p) in scores.iter().enumerate() {
            let vt = &v[(t * kv_n + g) * d..(t * kv_n + g + 1) * d];
            for (a, x) in acc.iter_mut().zip(vt) {
                *a += p * x;
            }
        }
        running.max[h] = new_max;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_data::pseudo;

    fn bytes(x: &[f32]) -> &[u8] {
        bytemuck::cast_slice(x)
    }

    /// Textbook attention over a contiguous cache, computed in f64.
    fn reference(shape: AttnShape, q: &[f32], k: &[f32], v: &[f32], n: usize) -> Vec<f32> {
        let (h_n, kv_n, d) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let mut out = vec![0.0f32; h_n * d];
        for h in 0..h_n {
            let g = h / (h_n / kv_n);
            let scores: Vec<f64> =
                (0..n).map(|t| (0..d).map(|i| q[h * d + i] as f64 * k[(t * kv_n + g) * d + i] as f64).sum::<f64>() / (d as f64).sqrt()).collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for i in 0..d {
                out[h * d + i] = (0..n).map(|t| e[t] / z * v[(t * kv_n + g) * d + i] as f64).sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn blockwise_equals_textbook_attention() {
        let shape = AttnShape { num_heads: 4, num_kv_heads: 2, head_dim: 8 };
        let n = 37;
        let row = shape.num_kv_heads * shape.head_dim;
        let (q, k, v) = (pseudo(32, 1), pseudo(n * row, 2), pseudo(n * row, 3));
        let want = reference(shape, &q, &k, &v, n);
        for block in [1, 5, 16, 37] {
            let blocks = (0..n).step_by(block).map(|s| {
                let e = (s + block).min(n);
                (bytes(&k[s * row..e * row]), bytes(&v[s * row..e * row]), e - s)
            });
            let mut out = vec![0.0; 32];
            attend(shape, 0..shape.num_kv_heads, &q, KvDtype::F32, blocks, &mut out, &mut Scratch::default());
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "block {block}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn kv_heads_attended_apart_give_the_bits_of_all_at_once() {
        let shape = AttnShape { num_heads: 8, num_kv_heads: 4, head_dim: 16 };
        let n = 45;
        let row = shape.num_kv_heads * shape.head_dim;
        let (q, k, v) = (pseudo(128, 11), pseudo(n * row, 12), pseudo(n * row, 13));
        let blocks = || (0..n).step_by(16).map(|s| (bytes(&k[s * row..(s + 16).min(n) * row]), bytes(&v[s * row..(s + 16).min(n) * row]), (s + 16).min(n) - s));
        let mut whole = vec![0.0; 128];
        attend(shape, 0..4, &q, KvDtype::F32, blocks(), &mut whole, &mut Scratch::default());
        // Query heads 2h and 2h + 1 read K/V head h: 32 floats of q and out per K/V head.
        for heads in [0..1, 1..3, 3..4] {
            let span = heads.start * 32..heads.end * 32;
            let mut part = vec![0.0; span.len()];
            attend(shape, heads.clone(), &q[span.clone()], KvDtype::F32, blocks(), &mut part, &mut Scratch::default());
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&part), bits(&whole[span]), "K/V heads {heads:?}");
        }
    }

    #[test]
    fn every_level_the_cpu_offers_gives_the_same_bits() {
        let shape = AttnShape { num_heads: 4, num_kv_heads: 2, head_dim: 40 };
        let (n, row) = (21, 80);
        let (q, k, v) = (pseudo(160, 4), pseudo(n * row, 5), pseudo(n * row, 6));
        let run = |level| {
            let mut running = Running { max: vec![0.5; 4], sum: vec![1.0; 4], scores: Vec::new() };
            let mut out = pseudo(160, 7);
            block_at(level, shape, 0, &q, &k, &v, &mut out, &mut running);
            out.iter().chain(&running.max).chain(&running.sum).map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        let want = run(crate::cpu::Level::Portable);
        for level in crate::cpu::Level::available() {
            assert_eq!(run(level), want, "{level:?} differs from portable");
        }
    }
}
