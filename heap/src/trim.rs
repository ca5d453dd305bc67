//! Gives freed heap back to the operating system. glibc keeps what a burst freed (the buffers
//! of thousands of refused connections in a worker; a restarted operator's first lists of
//! every object it owns) in its arenas, so RSS would stay near the peak although nothing holds
//! that memory; `malloc_trim` every few seconds returns it, and RSS tells what is held. It can
//! only do so for one arena: `malloc_trim` gives back the free top of the main arena alone, so
//! what a burst left at the top of a thread's arena (2-3 MiB of a worker's tokio threads after
//! hundreds of strangers' connections) stayed resident for good. A process that trims therefore
//! keeps every thread on the main arena (`one_arena`).

use std::time::Duration;

const EVERY: Duration = Duration::from_secs(2);

/// Puts every thread's allocations in glibc's main arena, so that the trimming thread can give
/// back all freed memory. Call first thing in `main`, before any thread starts (threads that
/// allocated already keep their own arenas); a no-op off glibc. The cost is one allocator lock
/// for all threads, which small allocations mostly skip (glibc's per-thread cache) and which
/// model steps take a few times per layer (their buffers are large and reused).
pub fn one_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets a glibc tuning parameter.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// Starts the trimming thread (once per process; a no-op off glibc).
pub fn give_back_freed_memory() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        std::thread::Builder::new()
            .name("malloc-trim".into())
            .spawn(|| {
                loop {
                    std::thread::sleep(EVERY);
                    // SAFETY: malloc_trim only releases free memory of glibc's own arenas; it
                    // takes no pointer and is thread-safe.
                    unsafe {
                        libc::malloc_trim(0);
                    }
                }
            })
            .expect("spawning the malloc-trim thread");
    });
}
