//! The lane layout every kernel sums in: sixteen independent partial sums (one AVX-512 vector,
//! two AVX2 ones), added pairwise at the end, so a sum's bits are the same at every level.

pub const LANES: usize = 16;

/// The lanes summed pairwise (8 + 8, 4 + 4, ...), whatever width the vectors had.
#[inline(always)]
pub fn reduce(mut lanes: [f32; LANES]) -> f32 {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            lanes[l] += lanes[l + width];
        }
    }
    lanes[0]
}

/// `a . b` over the lanes, the tail after the last whole chunk added last.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            lanes[l] += x[l] * y[l];
        }
    }
    reduce(lanes) + tail
}
