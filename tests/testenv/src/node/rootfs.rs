//! A container's writable root filesystem: an overlay of the shared unpacked image (read-only,
//! below) and the container's own upper directory, as containerd's overlayfs snapshotter gives
//! one. A start costs a mount, not a copy of the image (6.5 GB for the vLLM image).
//!
//! The mounts live in the agent's own mount namespace (`private_mounts`, called once at start):
//! they never appear in the host's and go when the agent does, however it ends. Where overlayfs
//! cannot be mounted (no private namespace, a kernel without it), the root is a copy as before.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

static PRIVATE: OnceLock<Result<(), String>> = OnceLock::new();

/// Moves this process into a mount namespace of its own, whose mounts propagate nowhere. Call
/// before any thread starts (`unshare(CLONE_NEWNS)` refuses a process that shares its
/// filesystem attributes with other threads).
pub fn private_mounts() -> Result<(), String> {
    PRIVATE
        .get_or_init(|| {
            // SAFETY: two syscalls with constant, NUL-terminated arguments.
            unsafe {
                if libc::unshare(libc::CLONE_NEWNS) != 0 {
                    return Err(format!("unshare(CLONE_NEWNS): {}", std::io::Error::last_os_error()));
                }
                if libc::mount(std::ptr::null(), c"/".as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()) != 0 {
                    return Err(format!("making / private: {}", std::io::Error::last_os_error()));
                }
            }
            Ok(())
        })
        .clone()
}

/// A fresh writable root for a container whose bundle is `dir`, over the image's `lower`: what
/// an earlier run of the container wrote is gone.
pub fn writable(dir: &Path, lower: &Path) -> Result<PathBuf, String> {
    release(dir);
    let root = dir.join("rootfs");
    for d in ["rootfs", "upper", "work"] {
        let _ = std::fs::remove_dir_all(dir.join(d));
        std::fs::create_dir_all(dir.join(d)).map_err(|e| format!("{}: {e}", dir.join(d).display()))?;
    }
    let overlay = match PRIVATE.get() {
        Some(Ok(())) => mount_overlay(lower, &dir.join("upper"), &dir.join("work"), &root),
        Some(Err(e)) => Err(e.clone()),
        None => Err("the agent's mounts are not private (rootfs::private_mounts was not called)".into()),
    };
    if let Err(why) = overlay {
        tracing::debug!(error = why, "no overlay for a writable root: copying the image");
        std::fs::remove_dir(&root).map_err(|e| format!("{}: {e}", root.display()))?;
        let out = Command::new("cp").arg("-a").arg(lower).arg(&root).output().map_err(|e| format!("cp: {e}"))?;
        if !out.status.success() {
            return Err(format!("copying the image's root filesystem: {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
    }
    Ok(root)
}

/// Unmounts the overlay of the bundle `dir`, if one is mounted (the directories stay).
pub fn release(dir: &Path) {
    let Ok(root) = CString::new(dir.join("rootfs").as_os_str().as_bytes()) else { return };
    // SAFETY: one syscall on a NUL-terminated path. EINVAL (not a mount point) is the common case.
    unsafe { libc::umount2(root.as_ptr(), libc::MNT_DETACH) };
}

fn mount_overlay(lower: &Path, upper: &Path, work: &Path, target: &Path) -> Result<(), String> {
    let options = format!("lowerdir={},upperdir={},workdir={}", lower.display(), upper.display(), work.display());
    if [lower, upper, work].iter().any(|p| p.as_os_str().as_bytes().iter().any(|b| matches!(b, b',' | b':'))) {
        return Err(format!("overlay options cannot name these paths: {options}"));
    }
    let c = |s: &[u8]| CString::new(s).map_err(|e| e.to_string());
    let (options, target) = (c(options.as_bytes())?, c(target.as_os_str().as_bytes())?);
    // SAFETY: one syscall on NUL-terminated strings that outlive it.
    let r = unsafe { libc::mount(c"overlay".as_ptr(), target.as_ptr(), c"overlay".as_ptr(), 0, options.as_ptr().cast()) };
    if r != 0 {
        return Err(format!("mounting overlayfs ({}): {}", options.to_string_lossy(), std::io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a private namespace (a test thread may not unshare) the root is a copy: writes
    /// to it never reach the image, and a second run starts from the image again.
    #[test]
    fn a_writable_root_is_the_image_and_its_writes_stay_its_own() {
        let base = std::env::temp_dir().join(format!("kvgate-rootfs-test-{}", std::process::id()));
        let (image, bundle) = (base.join("image"), base.join("bundle"));
        std::fs::create_dir_all(image.join("etc")).unwrap();
        std::fs::write(image.join("etc/motd"), "image\n").unwrap();
        let root = writable(&bundle, &image).unwrap();
        assert_eq!(std::fs::read_to_string(root.join("etc/motd")).unwrap(), "image\n");
        std::fs::write(root.join("etc/motd"), "written\n").unwrap();
        assert_eq!(std::fs::read_to_string(image.join("etc/motd")).unwrap(), "image\n", "the image is untouched");
        let root = writable(&bundle, &image).unwrap();
        assert_eq!(std::fs::read_to_string(root.join("etc/motd")).unwrap(), "image\n", "a new run starts from the image");
        release(&bundle);
        std::fs::remove_dir_all(&base).unwrap();
    }
}
