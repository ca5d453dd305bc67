//! Attention of one query token over K/V read block by block, with an online softmax.
//!
//! A block is a run of token slots `[slot][kv_head][head_dim]` for K and the same for V: one page
//! of one layer when reading the paged pool, or any run of a contiguous cache. Reading blocks
//! means the kernel never needs the sequence's KV gathered into one buffer.

use super::element::KvElem;
use crate::cpu::lanes::dot;
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

/// Per-call running state, reused across calls to avoid allocating in the hot loop.
#[derive(Debug, Default)]
pub struct Scratch {
    max: Vec<f32>,
    sum: Vec<f32>,
    scores: Vec<f32>,
}

/// `out[h] = softmax(q[h] . K^T / sqrt(d)) V` over all blocks, for every head `h`.
///
/// `q` and `out` are `[num_heads][head_dim]`. Query heads share K/V heads in groups
/// (grouped-query attention). Compiled for each CPU level (`crate::cpu`) and run at the chosen one.
pub fn attend<'a, E: KvElem + 'a>(
    shape: AttnShape,
    q: &[f32],
    blocks: impl Iterator<Item = (&'a [E], &'a [E], usize)>,
    out: &mut [f32],
    scratch: &mut Scratch,
) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::cpu::Level;
        #[target_feature(enable = "avx512f,avx2,fma")]
        fn avx512<'a, E: KvElem + 'a>(
            shape: AttnShape,
            q: &[f32],
            blocks: impl Iterator<Item = (&'a [E], &'a [E], usize)>,
            out: &mut [f32],
            scratch: &mut Scratch,
        ) {
            attend_body(shape, q, blocks, out, scratch)
        }
        #[target_feature(enable = "avx2,fma")]
        fn avx2<'a, E: KvElem + 'a>(
            shape: AttnShape,
            q: &[f32],
            blocks: impl Iterator<Item = (&'a [E], &'a [E], usize)>,
            out: &mut [f32],
            scratch: &mut Scratch,
        ) {
            attend_body(shape, q, blocks, out, scratch)
        }
        match crate::cpu::level() {
            // SAFETY: `level()` names only a level whose features the CPU reported.
            Level::Avx512 => return unsafe { avx512(shape, q, blocks, out, scratch) },
            Level::Avx2 => return unsafe { avx2(shape, q, blocks, out, scratch) },
            Level::Portable => {}
        }
    }
    attend_body(shape, q, blocks, out, scratch)
}

#[inline(always)]
fn attend_body<'a, E: KvElem + 'a>(
    shape: AttnShape,
    q: &[f32],
    blocks: impl Iterator<Item = (&'a [E], &'a [E], usize)>,
    out: &mut [f32],
    scratch: &mut Scratch,
) {
    let (h_n, kv_n, d) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    let group = shape.group();
    let scale = 1.0 / (d as f32).sqrt();
    scratch.max.clear();
    scratch.max.resize(h_n, f32::NEG_INFINITY);
    scratch.sum.clear();
    scratch.sum.resize(h_n, 0.0);
    out[..h_n * d].fill(0.0);

    for (k, v, n) in blocks {
        if scratch.scores.len() < n {
            scratch.scores.resize(n, 0.0);
        }
        for h in 0..h_n {
            let g = h / group;
            let qh = &q[h * d..(h + 1) * d];
            let scores = &mut scratch.scores[..n];
            for (t, s) in scores.iter_mut().enumerate() {
                *s = dot(qh, &k[(t * kv_n + g) * d..(t * kv_n + g + 1) * d]) * scale;
            }
            let old_max = scratch.max[h];
            let new_max = old_max.max(softmax::row_max_body(scores));
            let acc = &mut out[h * d..(h + 1) * d];
            if old_max != f32::NEG_INFINITY && old_max != new_max {
                let correction = softmax::exp(old_max - new_max);
                scratch.sum[h] *= correction;
                acc.iter_mut().for_each(|a| *a *= correction);
            }
            scratch.sum[h] += softmax::exp_sum_body(scores, new_max);
            for (t, &p) in scores.iter().enumerate() {
                let vt = &v[(t * kv_n + g) * d..(t * kv_n + g + 1) * d];
                for (a, x) in acc.iter_mut().zip(vt) {
                    *a += p * x.to_f32();
                }
            }
            scratch.max[h] = new_max;
        }
    }
    for h in 0..h_n {
        let inv = 1.0 / scratch.sum[h];
        out[h * d..(h + 1) * d].iter_mut().for_each(|a| *a *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn pseudo(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0).collect()
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
                (&k[s * row..e * row], &v[s * row..e * row], e - s)
            });
            let mut out = vec![0.0; 32];
            attend(shape, &q, blocks, &mut out, &mut Scratch::default());
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "block {block}: {a} vs {b}");
            }
        }
    }
}
