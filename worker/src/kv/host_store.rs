//! Page storage in host memory, committed up front, one lock per page.
//!
//! Each page is its own allocation behind its own lock, so a model step writing one sequence's
//! pages, a handoff receiver filling another's and a sender reading a third never wait for one
//! another: only two users of the *same* page do (which the leases already rule out).

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::{KvLayout, StoreError};

/// A page's bytes, kept as `u32` words so every page is aligned for f32, f16 and bf16 reads.
pub type PageWords = Box<[u32]>;

pub struct HostStore {
    pages: Box<[RwLock<PageWords>]>,
    page_bytes: usize,
}

impl HostStore {
    /// Allocates and *commits* `num_pages` pages: every byte is written once, so the kernel has
    /// really backed the memory and the reported capacity is true, not an overcommit promise.
    pub fn allocate(layout: &KvLayout, num_pages: usize) -> Result<Self, StoreError> {
        let page_bytes = layout.page_bytes();
        num_pages.checked_mul(page_bytes).ok_or(StoreError::TooLarge { pages: num_pages })?;
        let words = page_bytes.div_ceil(4);
        let mut pages = Vec::new();
        pages.try_reserve_exact(num_pages).map_err(|_| StoreError::OutOfMemory { bytes: (num_pages * page_bytes) as u64 })?;
        for _ in 0..num_pages {
            let mut page: Vec<u32> = Vec::new();
            page.try_reserve_exact(words).map_err(|_| StoreError::OutOfMemory { bytes: (num_pages * page_bytes) as u64 })?;
            // `resize` writes every word, faulting in the memory now rather than at first use.
            page.resize(words, 0);
            pages.push(RwLock::new(page.into_boxed_slice()));
        }
        Ok(HostStore { pages: pages.into_boxed_slice(), page_bytes })
    }

    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Page `id`, shared with other readers.
    pub fn read(&self, id: u32) -> RwLockReadGuard<'_, PageWords> {
        // A panic while holding a page lock leaves bytes, never bookkeeping: still usable.
        self.pages[id as usize].read().unwrap_or_else(|p| p.into_inner())
    }

    /// Page `id`, exclusively.
    pub fn write(&self, id: u32) -> RwLockWriteGuard<'_, PageWords> {
        self.pages[id as usize].write().unwrap_or_else(|p| p.into_inner())
    }
}

/// The first `len` bytes of a page's words.
pub fn bytes(words: &[u32], len: usize) -> &[u8] {
    &bytemuck::cast_slice(words)[..len]
}

pub fn bytes_mut(words: &mut [u32], len: usize) -> &mut [u8] {
    &mut bytemuck::cast_slice_mut(words)[..len]
}
