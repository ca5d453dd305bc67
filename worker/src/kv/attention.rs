//! Attention of one query token over K/V read block by block, with an online softmax.
//!
//! A block is a run of token slots `[slot][kv_head][head_dim]` for K and the same for V: one page
//! of one layer when reading the paged pool, or any run of a contiguous cache. Reading blocks
//! means the kernel never needs the sequence's KV gathered into one buffer.

use super::element::KvElem;

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
/// (grouped-query attention).
pub fn attend<'a, E: KvElem + 'a>(
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
            let mut block_max = f32::NEG_INFINITY;
            for (t, s) in scores.iter_mut().enumerate() {
                let kt = &k[(t * kv_n + g) * d..(t * kv_n + g + 1) * d];
                *s = dot(qh, kt) * scale;
                block_max = block_max.max(*s);
            }
            let old_max = scratch.max[h];
            let new_max = old_max.max(block_max);
            let acc = &mut out[h * d..(h + 1) * d];
            if old_max != f32::NEG_INFINITY && old_max != new_max {
                let correction = (old_max - new_max).exp();
                scratch.sum[h] *= correction;
                acc.iter_mut().for_each(|a| *a *= correction);
            }
            for (t, s) in scores.iter().enumerate() {
                let p = (s - new_max).exp();
                scratch.sum[h] += p;
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

#[inline(always)]
fn dot<E: KvElem>(q: &[f32], k: &[E]) -> f32 {
    // Four accumulators let the compiler keep several lanes busy.
    let mut acc = [0.0f32; 4];
    let chunks = q.len() / 4;
    for i in 0..chunks {
        for j in 0..4 {
            acc[j] += q[i * 4 + j] * k[i * 4 + j].to_f32();
        }
    }
    let mut total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for i in chunks * 4..q.len() {
        total += q[i] * k[i].to_f32();
    }
    total
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
