//! Attention of a multi-token step (a prefill chunk) as tiled matrix products with an online
//! softmax: per head, a block of queries against tiles of the sequence's keys (gathered from its
//! pages), scores and weighted values by `gemm`, never the whole score matrix in memory. Tiles
//! past a query block's last position are skipped (causal), as are tiles before a sliding
//! window. The work is split across the compute threads. A one-token step keeps the paged kernel
//! (`kv::attention`), which reads pages in place.

use rayon::prelude::*;

use crate::cpu::softmax;
use crate::kv::AttnShape;

/// Queries per block and keys per tile: a block's scores (`QUERIES x KEYS` f32, 128 KiB) stay in
/// the core's L2.
const QUERIES: usize = 64;
const KEYS: usize = 512;

/// Where one head's rows are in the flat inputs.
#[derive(Clone, Copy)]
struct Operands<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    shape: AttnShape,
    first_query: usize,
    first_key: usize,
    window: Option<usize>,
}

/// `q`: `[n][heads * head_dim]` for positions `first_query..`; `k`, `v`: `[m][kv_heads *
/// head_dim]` for positions `first_key..`. A query at position p sees keys at positions up to p,
/// and with a window `w` only those after `p - w`. Returns `[n][heads * head_dim]`.
pub fn attend_chunk(shape: AttnShape, q: &[f32], k: &[f32], v: &[f32], first_query: usize, first_key: usize, window: Option<usize>) -> Vec<f32> {
    let (h, d) = (shape.num_heads, shape.head_dim);
    let n = q.len() / (h * d);
    let ops = Operands { q, k, v, shape, first_query, first_key, window };
    // Units of work: (head, query block), spread over the compute threads (rayon's pool, which
    // the matrix products use too, so nothing is spawned per call).
    let units: Vec<(usize, usize)> = (0..h).flat_map(|head| (0..n).step_by(QUERIES).map(move |b| (head, b))).collect();
    let results: Vec<(usize, usize, Vec<f32>)> =
        units.par_iter().map_init(Tile::default, |tile, &(head, b)| (head, b, tile.block(&ops, head, b, QUERIES.min(n - b)))).collect();
    let mut out = vec![0.0f32; n * h * d];
    for (head, b, rows) in results {
        for (i, row) in rows.chunks(d).enumerate() {
            out[((b + i) * h + head) * d..][..d].copy_from_slice(row);
        }
    }
    out
}

/// One worker's buffers, reused from block to block.
#[derive(Default)]
struct Tile {
    scores: Vec<f32>,
    acc: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

impl Tile {
    /// Attention of queries `b..b + rows` of `head`: `[rows][head_dim]`.
    fn block(&mut self, o: &Operands, head: usize, b: usize, rows: usize) -> Vec<f32> {
        let AttnShape { num_heads: h, num_kv_heads: kv, head_dim: d } = o.shape;
        let g = head / (h / kv);
        let m = o.k.len() / (kv * d);
        let (p0, p1) = (o.first_query + b, o.first_query + b + rows - 1);
        // Keys any query of the block sees: up to its last position, after its first's window.
        let lo = o.window.map_or(0, |w| (p0 + 1).saturating_sub(w)).max(o.first_key) - o.first_key;
        let hi = (p1 + 1 - o.first_key).min(m);
        let scale = 1.0 / (d as f32).sqrt();
        self.acc.clear();
        self.acc.resize(rows * d, 0.0);
        self.max.clear();
        self.max.resize(rows, f32::NEG_INFINITY);
        self.sum.clear();
        self.sum.resize(rows, 0.0);
        self.scores.resize(QUERIES * KEYS, 0.0);
        let q = &o.q[(b * h + head) * d..];
        for k0 in (lo..hi).step_by(KEYS) {
            let cols = KEYS.min(hi - k0);
            let k = &o.k[(k0 * kv + g) * d..];
            let v = &o.v[(k0 * kv + g) * d..];
            // scores[i][j] = scale * q_i . k_j
            // SAFETY: every pointer and stride stays inside its slice: `rows` query rows of
            // stride h*d from `q`, `cols` key rows of stride kv*d from `k`, and a
            // `rows x cols` block of `scores` (row stride KEYS).
            unsafe {
                gemm::gemm(
                    rows,
                    cols,
                    d,
                    self.scores.as_mut_ptr(),
                    1,
                    KEYS as isize,
                    false,
                    q.as_ptr(),
                    1,
                    (h * d) as isize,
                    k.as_ptr(),
                    (kv * d) as isize,
                    1,
                    0.0,
                    scale,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            for i in 0..rows {
                let p = p0 + i;
                // The tile's visible keys for this query: a range (causal, then the window).
                let key0 = o.first_key + k0;
                let end = (p + 1).saturating_sub(key0).min(cols);
                let start = o.window.map_or(0, |w| (p + 1).saturating_sub(w).saturating_sub(key0)).min(end);
                let row = &mut self.scores[i * KEYS..i * KEYS + cols];
                if start == end {
                    row.fill(0.0); // nothing visible to this query in this tile
                    continue;
                }
                let new_max = self.max[i].max(softmax::row_max(&row[start..end]));
                let correction = softmax::exp(self.max[i] - new_max);
                row[..start].fill(0.0);
                row[end..].fill(0.0);
                let total = softmax::exp_sum(&mut row[start..end], new_max);
                self.sum[i] = self.sum[i] * correction + total;
                self.max[i] = new_max;
                self.acc[i * d..(i + 1) * d].iter_mut().for_each(|a| *a *= correction);
            }
            // acc += P V
            // SAFETY: `rows x cols` of `scores`, `cols` value rows of stride kv*d from `v`, and
            // `rows x d` of `acc`, all inside their slices.
            unsafe {
                gemm::gemm(
                    rows,
                    d,
                    cols,
                    self.acc.as_mut_ptr(),
                    1,
                    d as isize,
                    true,
                    self.scores.as_ptr(),
                    1,
                    KEYS as isize,
                    v.as_ptr(),
                    1,
                    (kv * d) as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        }
        for i in 0..rows {
            let inv = 1.0 / self.sum[i];
            self.acc[i * d..(i + 1) * d].iter_mut().for_each(|a| *a *= inv);
        }
        self.acc.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::Scratch;
    use crate::kv::attention::attend;
    use crate::test_data::pseudo;

    /// Each query row equals the paged kernel over the keys that query may see, across block
    /// and tile boundaries.
    #[test]
    fn a_chunk_equals_the_one_token_kernel_row_by_row() {
        let shape = AttnShape { num_heads: 4, num_kv_heads: 2, head_dim: 8 };
        let (qw, kw) = (32, 16);
        for (first_query, n, window) in [(0usize, 9usize, None), (5, 7, None), (5, 7, Some(3usize)), (0, 20, Some(6)), (300, 150, None), (0, 700, Some(270))] {
            let first_key = window.map_or(0, |w| (first_query + 1).saturating_sub(w));
            let m = first_query + n - first_key;
            let (q, k, v) = (pseudo(n * qw, 1), pseudo(m * kw, 2), pseudo(m * kw, 3));
            let got = attend_chunk(shape, &q, &k, &v, first_query, first_key, window);
            for i in 0..n {
                let p = first_query + i;
                let from = window.map_or(0, |w| (p + 1).saturating_sub(w)) - first_key;
                let to = p + 1 - first_key;
                let mut want = vec![0.0; qw];
                attend(
                    shape,
                    0..shape.num_kv_heads,
                    &q[i * qw..(i + 1) * qw],
                    std::iter::once((&k[from * kw..to * kw], &v[from * kw..to * kw], to - from)),
                    &mut want,
                    &mut Scratch::default(),
                );
                let diff = want.iter().zip(&got[i * qw..(i + 1) * qw]).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
                assert!(diff < 1e-5, "query {p} (window {window:?}) differs by {diff}");
            }
        }
    }
}
