//! Attention of a multi-token step (a prefill chunk) as tiled matrix products with an online
//! softmax: per head, a block of queries against tiles of the sequence's keys (gathered from its
//! pages), scores and weighted values by `gemm`, never the whole score matrix in memory. Tiles
//! past a query block's last position are skipped (causal), as are tiles before a sliding
//! window. The work is split across the compute threads. A one-token step keeps the paged kernel
//! (`kv::attention`), which reads pages in place.
//!
//! Every operand is laid out so that `gemm` packs nothing: it packed the same key and value tile
//! for every query block of every head (a third of the attention's time at 8k tokens). Instead
//! each call lays the keys and values out once per KV head (`HeadMajor`), keys transposed per
//! tile, with row strides that are not a power of two so that walking a column does not evict
//! itself from L1; the products are then `S^T = K Q^T` and `acc^T = V^T P^T`, whose left operands
//! are column-major and whose right operands (queries, scores) are read in place.

use rayon::prelude::*;

use crate::cpu::softmax;
use crate::kv::AttnShape;

/// Queries per block and keys per tile: a block's scores (`QUERIES x KEYS` f32, 96 KiB) stay in
/// the core's L2. `gemm` packs a left operand when the right one has more than 8 microkernel
/// columns (6 with AVX2), so a block stays at 48 queries.
const QUERIES: usize = 48;
const KEYS: usize = 512;
/// Padding of a laid-out row (f32s), so that row strides are not a power of two.
const PAD: usize = 16;
/// Row stride of the score block.
const SCORE_ROW: usize = KEYS + PAD;

/// Where one head's rows are in the flat inputs.
#[derive(Clone, Copy)]
struct Operands<'a> {
    q: &'a [f32],
    kv: &'a HeadMajor,
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
    let kv = HeadMajor::new(shape, k, v);
    let ops = Operands { q, kv: &kv, shape, first_query, first_key, window };
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

/// The keys and values of one call, grouped by KV head: per head and tile of `KEYS` keys, the
/// keys as columns (`[head_dim][KEYS + PAD]`); per head, the values as rows (`[m][head_dim + PAD]`).
struct HeadMajor {
    keys: Vec<f32>,
    values: Vec<f32>,
    m: usize,
    tiles: usize,
    head_dim: usize,
}

impl HeadMajor {
    fn new(shape: AttnShape, k: &[f32], v: &[f32]) -> Self {
        let (kv, d) = (shape.num_kv_heads, shape.head_dim);
        let m = k.len() / (kv * d);
        let tiles = m.div_ceil(KEYS);
        let mut keys = vec![0.0f32; kv * tiles * d * (KEYS + PAD)];
        let mut values = vec![0.0f32; kv * m * (d + PAD)];
        for (j, (krow, vrow)) in k.chunks_exact(kv * d).zip(v.chunks_exact(kv * d)).enumerate() {
            let (t, col) = (j / KEYS, j % KEYS);
            for g in 0..kv {
                let tile = &mut keys[(g * tiles + t) * d * (KEYS + PAD)..];
                for (c, &x) in krow[g * d..(g + 1) * d].iter().enumerate() {
                    tile[c * (KEYS + PAD) + col] = x;
                }
                values[(g * m + j) * (d + PAD)..][..d].copy_from_slice(&vrow[g * d..(g + 1) * d]);
            }
        }
        HeadMajor { keys, values, m, tiles, head_dim: d }
    }

    /// Head `g`'s keys of tile `t`: column j is key `t * KEYS + j` (column stride 1, row stride
    /// `KEYS + PAD`).
    fn key_tile(&self, g: usize, t: usize) -> &[f32] {
        &self.keys[(g * self.tiles + t) * self.head_dim * (KEYS + PAD)..]
    }

    /// Head `g`'s values from key `j` on (row stride `head_dim + PAD`).
    fn values_from(&self, g: usize, j: usize) -> &[f32] {
        &self.values[(g * self.m + j) * (self.head_dim + PAD)..]
    }
}

/// One worker's buffers, reused from block to block.
#[derive(Default)]
struct Tile {
    /// The block's queries, `[rows][head_dim + PAD]`.
    queries: Vec<f32>,
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
        let m = o.kv.m;
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
        self.scores.resize(QUERIES * SCORE_ROW, 0.0);
        self.queries.resize(QUERIES * (d + PAD), 0.0);
        for (i, row) in self.queries.chunks_exact_mut(d + PAD).take(rows).enumerate() {
            row[..d].copy_from_slice(&o.q[((b + i) * h + head) * d..][..d]);
        }
        let q = &self.queries;
        // Whole tiles from the one holding `lo`: keys before `lo` in it are masked below.
        for k0 in (lo / KEYS * KEYS..hi).step_by(KEYS) {
            let cols = KEYS.min(hi - k0);
            let kt = o.kv.key_tile(g, k0 / KEYS);
            let v = o.kv.values_from(g, k0);
            // scores[i][j] = scale * q_i . k_j, as S^T (keys x queries) = K Q^T: the left operand
            // is K transposed (column-major), the right one the queries' rows.
            // SAFETY: every pointer and stride stays inside its slice: `cols` keys of `head_dim`
            // rows of stride KEYS + PAD from `kt`, `rows` query rows of stride d + PAD from `q`, and
            // a `rows x cols` block of `scores` (row stride SCORE_ROW).
            unsafe {
                gemm::gemm(
                    cols,
                    rows,
                    d,
                    self.scores.as_mut_ptr(),
                    SCORE_ROW as isize,
                    1,
                    false,
                    kt.as_ptr(),
                    (KEYS + PAD) as isize,
                    1,
                    q.as_ptr(),
                    (d + PAD) as isize,
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
                let row = &mut self.scores[i * SCORE_ROW..i * SCORE_ROW + cols];
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
            // acc += P V, as acc^T (head_dim x queries) += V^T P^T: V's rows and the scores' rows
            // are read in place.
            // SAFETY: `cols` value rows of stride d + PAD from `v`, `rows x cols` of `scores` (row
            // stride SCORE_ROW) and `rows x d` of `acc`, all inside their slices.
            unsafe {
                gemm::gemm(
                    d,
                    rows,
                    cols,
                    self.acc.as_mut_ptr(),
                    d as isize,
                    1,
                    true,
                    v.as_ptr(),
                    (d + PAD) as isize,
                    1,
                    self.scores.as_ptr(),
                    SCORE_ROW as isize,
                    1,
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
    use crate::kv::attention::attend;
    use crate::kv::{KvDtype, Scratch};
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
                    KvDtype::F32,
                    std::iter::once((bytemuck::cast_slice(&k[from * kw..to * kw]), bytemuck::cast_slice(&v[from * kw..to * kw]), to - from)),
                    &mut want,
                    &mut Scratch::default(),
                );
                let diff = want.iter().zip(&got[i * qw..(i + 1) * qw]).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
                assert!(diff < 1e-5, "query {p} (window {window:?}) differs by {diff}");
            }
        }
    }
}
