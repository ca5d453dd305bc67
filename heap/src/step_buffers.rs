//! Keeps the buffers of one model step for the next. A step allocates its activations afresh
//! (megabytes per layer for a prefill chunk); glibc serves allocations above its mmap threshold
//! with fresh mappings and trims the heap's top on every free, so each step faulted its pages in
//! again and the kernel zeroed them: a fifth of a 512-token prefill. Raising both thresholds
//! keeps the freed buffers in the heap, where the next step finds them; the worker's periodic
//! `malloc_trim` (`give_back_freed_memory`) still returns them when idle.

/// Allocations up to this size come from the heap (glibc's largest allowed mmap threshold).
const MMAP_THRESHOLD: i32 = 32 << 20;
/// Free memory at the heap's top kept on `free` (the trimming thread gives it back later).
const TRIM_THRESHOLD: i32 = 1 << 30;

/// Call first thing in `main` of a process that runs a model (a no-op off glibc). A router does
/// not: the thresholds would keep the buffers of a burst of connections past its trim.
pub fn keep_step_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets glibc's tuning parameters; called before other threads start.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
    }
}
