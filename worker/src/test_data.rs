//! Deterministic pseudo-random inputs for the kernels' unit tests, and scratch directories.

/// `n` values in [-1, 1), the same for the same `seed`.
pub fn pseudo(n: usize, seed: u32) -> Vec<f32> {
    (0..n).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0).collect()
}

/// A directory of the test's own under the system's temporary directory, removed (with what the
/// test wrote there) when dropped.
pub struct TempDir(std::path::PathBuf);

impl TempDir {
    /// `kvgate-{name}-{pid}`, emptied if a run before left it.
    pub fn new(name: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("kvgate-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl std::ops::Deref for TempDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
