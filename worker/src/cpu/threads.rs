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

/// Makes the calling thread the first of a pool of `RAYON_NUM_THREADS` compute threads, so the
/// parallel loops of a model step are forked and joined by the thread that runs the step. Run
/// from a thread outside the pool, each of a decode step's some forty matrix-vector products
/// was a job handed to the pool and a wait for its end: the stepping thread slept and woke per
/// product, and did its own serial work (attention, norms, sampling) while the pool's threads
/// spun on the same cores. The pool lives as long as the value returned (none when the pool
/// cannot start: the loops then run on rayon's global pool, as before).
pub fn join_compute_pool() -> Option<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .use_current_thread()
        .thread_name(|i| format!("kvgate-compute-{i}"))
        .build()
        .inspect_err(|e| tracing::warn!(error = %e, "the engine's compute threads did not start; using rayon's global pool"))
        .ok()
}

#[cfg(test)]
mod tests {
    /// The thread that joins the pool forks and joins its loops itself: it is worker 0, and a
    /// parallel loop it starts runs partly on it.
    #[test]
    fn the_joining_thread_runs_its_own_parallel_loops() {
        std::thread::spawn(|| {
            assert_eq!(rayon::current_thread_index(), None);
            let pool = super::join_compute_pool().expect("the pool starts");
            assert_eq!(rayon::current_thread_index(), Some(0));
            assert_eq!(rayon::current_num_threads(), pool.current_num_threads());
            use rayon::prelude::*;
            let ran_here = (0..64).into_par_iter().filter(|_| rayon::current_thread_index() == Some(0)).count();
            assert!(ran_here > 0, "no iteration ran on the joining thread");
        })
        .join()
        .unwrap();
    }
}
