//! Gives freed heap back to the operating system. glibc keeps what a burst freed (the buffers
//! of thousands of refused connections in a worker; a restarted operator's first lists of
//! every object it owns) in its arenas, so RSS would stay near the peak although nothing holds
//! that memory; `malloc_trim` every few seconds returns it, and RSS tells what is held.

use std::time::Duration;

const EVERY: Duration = Duration::from_secs(2);

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
