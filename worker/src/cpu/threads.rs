//! How many threads the compute kernels use, decided once at start-up.

/// Fixes the compute threads in `RAYON_NUM_THREADS` (unless the operator set it) before any
/// thread starts. candle otherwise works the count out on every matrix product by reading
/// `/proc/cpuinfo`, which cost a third of a small model's decode step. The count is candle's own
/// choice (the process's CPU mask or its physical cores), so behaviour is unchanged.
///
/// Call it first thing in `main`, while the process has one thread.
pub fn fix_from_machine() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = candle_core::utils::get_num_threads();
        // SAFETY: called from `main` before any other thread exists, so no one reads the
        // environment concurrently.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", n.to_string()) };
    }
}
