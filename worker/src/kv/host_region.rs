//! One anonymous mapping holding every page of a host KV pool, advised for transparent huge
//! pages.
//!
//! A gigabyte of KV in 4 KiB pages is a quarter million TLB entries' worth: the kernel's copy
//! into a page as a handoff lands, the page tag over it and attention reading it all walk page
//! tables. Backed by 2 MiB pages (where the kernel allows them: `madvise` mode, the default of
//! most distributions, grants them only to regions that ask) a loopback stream into such memory
//! ran 10-20% faster here. The mapping starts on a 2 MiB boundary so every 2 MiB page of KV is
//! one huge page.

use std::ptr::NonNull;

const HUGE_PAGE: usize = 2 << 20;
const BASE_PAGE: usize = 4 << 10;

pub struct HostRegion {
    start: NonNull<u8>,
    len: usize,
}

// SAFETY: the region is plain memory owned by this value; who may touch which bytes is decided
// by the store that carves it into pages (one lock per page).
unsafe impl Send for HostRegion {}
// SAFETY: as for Send.
unsafe impl Sync for HostRegion {}

impl HostRegion {
    /// Maps `len` bytes (rounded up to whole huge pages), asks for huge pages and commits every
    /// byte: each base page is written once, so the kernel has really backed the memory and a
    /// reported capacity is not an overcommit promise. `None` when the mapping is refused.
    pub fn commit(len: usize) -> Option<Self> {
        let len = len.checked_next_multiple_of(HUGE_PAGE)?.max(HUGE_PAGE);
        let padded = len.checked_add(HUGE_PAGE)?;
        // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
        let raw = unsafe { libc::mmap(std::ptr::null_mut(), padded, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let raw = raw as usize;
        let start = raw.next_multiple_of(HUGE_PAGE);
        // SAFETY: both ranges lie inside the mapping just made and outside [start, start + len).
        unsafe {
            if start > raw {
                libc::munmap(raw as *mut libc::c_void, start - raw);
            }
            let tail = raw + padded - (start + len);
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
            // Advice only: without THP in the kernel this fails and the region keeps base pages.
            libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        let region = HostRegion { start: NonNull::new(start as *mut u8)?, len };
        for offset in (0..len).step_by(BASE_PAGE) {
            // SAFETY: inside the region; volatile so the touch is not folded away.
            unsafe { region.start.as_ptr().add(offset).write_volatile(0) };
        }
        Some(region)
    }

    /// The region's first byte. Whoever writes through it must not overlap another writer.
    pub fn start(&self) -> NonNull<u8> {
        self.start
    }
}

/// A region with one user, who may see it whole as bytes: a buffer that is not a pool (the
/// handoff bench's, so a `testing` build's only). A pool's `HostRegion` gives out no slice of
/// itself: its pages are reached only through the store's per-page locks, so nothing can alias
/// a page another thread writes.
#[cfg(feature = "testing")]
pub struct HostBuffer(HostRegion);

#[cfg(feature = "testing")]
impl HostBuffer {
    /// As `HostRegion::commit`.
    pub fn commit(len: usize) -> Option<Self> {
        HostRegion::commit(len).map(HostBuffer)
    }
}

#[cfg(feature = "testing")]
impl std::ops::Deref for HostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the region's bytes, all committed; the buffer owns the region alone, and
        // `&self` rules out a writer through `&mut`.
        unsafe { std::slice::from_raw_parts(self.0.start.as_ptr(), self.0.len) }
    }
}

#[cfg(feature = "testing")]
impl std::ops::DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above; `&mut self` rules out any other user.
        unsafe { std::slice::from_raw_parts_mut(self.0.start.as_ptr(), self.0.len) }
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `commit`, unmapped once.
        unsafe { libc::munmap(self.start.as_ptr() as *mut libc::c_void, self.len) };
    }
}
