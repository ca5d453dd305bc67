//! A directory made once per tree (a wheel unpacked, an image unpacked) by code that tests run
//! in parallel: the threads of one test binary share a process id, and test binaries or node
//! agents may share the tree. Each maker fills a directory of its own and renames it into place;
//! whoever renames first wins and the others drop their copy, so a reader never sees a partial
//! directory and no maker pulls another's from under it.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// `dest`, filled by `fill` (given an empty scratch directory beside it) unless `ready(dest)`
/// already holds. Within a process one caller fills at a time; across processes the rename
/// decides.
pub fn make_once(dest: &Path, ready: impl Fn(&Path) -> bool, fill: impl FnOnce(&Path) -> Result<(), String>) -> Result<PathBuf, String> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    if ready(dest) {
        return Ok(dest.to_path_buf());
    }
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if ready(dest) {
        return Ok(dest.to_path_buf());
    }
    let scratch = scratch_beside(dest);
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).map_err(|e| format!("{}: {e}", scratch.display()))?;
    let filled = fill(&scratch);
    let placed = filled.and_then(|()| match std::fs::rename(&scratch, dest) {
        Ok(()) => Ok(()),
        // Another process placed its copy first: either copy is whole.
        Err(_) if ready(dest) => Ok(()),
        Err(e) => Err(format!("moving {} to {}: {e}", scratch.display(), dest.display())),
    });
    let _ = std::fs::remove_dir_all(&scratch);
    placed.map(|()| dest.to_path_buf())
}

/// A name beside `dest` no other maker uses: the process id and a per-process count.
fn scratch_beside(dest: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    dest.with_file_name(format!(".{name}.partial-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The failure of the cold CI run: several threads making the same directory at once. Every
    /// caller must get a whole directory, and no scratch copy may be left.
    #[test]
    fn parallel_makers_all_get_a_whole_directory() {
        let base = std::env::temp_dir().join(format!("kvgate-once-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let dest = base.join("site");
        let ready = |d: &Path| d.join("b").is_file();
        let fills = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    let got = make_once(&dest, ready, |dir| {
                        fills.fetch_add(1, Ordering::Relaxed);
                        std::fs::write(dir.join("a"), "a").unwrap();
                        std::thread::sleep(std::time::Duration::from_millis(50));
                        std::fs::write(dir.join("b"), "b").unwrap();
                        Ok(())
                    })
                    .unwrap();
                    assert_eq!(std::fs::read_to_string(got.join("a")).unwrap(), "a");
                    assert_eq!(std::fs::read_to_string(got.join("b")).unwrap(), "b");
                });
            }
        });
        assert_eq!(fills.load(Ordering::Relaxed), 1, "one process fills once");
        let left: Vec<_> = std::fs::read_dir(&base).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("site")], "no scratch copy is left beside it");
        // A failed fill places nothing, leaves nothing, and says why.
        let other = base.join("other");
        let err = make_once(&other, ready, |_| Err("no wheel".into())).unwrap_err();
        assert_eq!(err, "no wheel");
        assert!(!other.exists());
        assert_eq!(std::fs::read_dir(&base).unwrap().count(), 1);
        std::fs::remove_dir_all(&base).unwrap();
    }
}
