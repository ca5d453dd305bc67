//! Deterministic pseudo-random inputs for the kernels' unit tests.

/// `n` values in [-1, 1), the same for the same `seed`.
pub fn pseudo(n: usize, seed: u32) -> Vec<f32> {
    (0..n).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0).collect()
}
