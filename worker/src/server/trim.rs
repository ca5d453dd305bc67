//! Gives freed heap back to the operating system. glibc keeps what a burst freed (the buffers
//! of thousands of refused or timed-out connections) in its arenas, so after an attack a
//! worker's RSS would stay near its peak although nothing holds that memory; `malloc_trim`
//! every few seconds returns it, so memory after a burst tells the truth about what is held.

use std::time::Duration;

const EVERY: Duration = Duration::from_secs(2);

/// Starts the trimming task (once per process; a no-op off glibc).
pub fn start() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        tokio::spawn(async {
            loop {
                tokio::time::sleep(EVERY).await;
                // SAFETY: malloc_trim only releases free memory of glibc's own arenas; it takes
                // no pointer and is thread-safe.
                unsafe {
                    libc::malloc_trim(0);
                }
            }
        });
    });
}
