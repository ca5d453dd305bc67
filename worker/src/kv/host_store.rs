//! Page storage in host memory, committed up front, one lock per page.
//!
//! Every page lives in one region (`host_region.rs`: huge pages where the kernel grants them),
//! each behind its own lock, so a model step writing one sequence's pages, a handoff receiver
//! filling another's and a sender reading a third never wait for one another: only two users of
//! the *same* page do (which the leases already rule out).

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::host_region::HostRegion;
use super::{KvLayout, StoreError};

/// A page's bytes, seen as `u32` words so every page is aligned for f32, f16 and bf16 reads.
pub struct PageWords {
    start: NonNull<u32>,
    words: usize,
}

// SAFETY: a `PageWords` covers its own stretch of the store's region, which no other page
// overlaps and which outlives it; it is only reached through its page's lock.
unsafe impl Send for PageWords {}
// SAFETY: as for Send.
unsafe impl Sync for PageWords {}

impl Deref for PageWords {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        // SAFETY: see the `Send`/`Sync` note; shared access under the page's read lock.
        unsafe { std::slice::from_raw_parts(self.start.as_ptr(), self.words) }
    }
}

impl DerefMut for PageWords {
    fn deref_mut(&mut self) -> &mut [u32] {
        // SAFETY: exclusive access under the page's write lock.
        unsafe { std::slice::from_raw_parts_mut(self.start.as_ptr(), self.words) }
    }
}

pub struct HostStore {
    // Declared before the region, so dropped before it.
    pages: Box<[RwLock<PageWords>]>,
    page_bytes: usize,
    _region: HostRegion,
}

impl HostStore {
    /// Allocates and *commits* `num_pages` pages (see `HostRegion::commit`): the kernel has
    /// really backed the memory and the reported capacity is true, not an overcommit promise.
    pub fn allocate(layout: &KvLayout, num_pages: usize) -> Result<Self, StoreError> {
        let page_bytes = layout.page_bytes();
        let words = page_bytes.div_ceil(4);
        // Each page starts on a cache line; 2 MiB pages start on huge pages.
        let stride = (words * 4).next_multiple_of(64);
        let total = num_pages.checked_mul(stride).ok_or(StoreError::TooLarge { pages: num_pages })?;
        let region = HostRegion::commit(total).ok_or(StoreError::OutOfMemory { bytes: total as u64 })?;
        let pages = (0..num_pages)
            .map(|i| {
                // SAFETY: page i spans [i * stride, i * stride + words * 4), inside the region.
                let start = unsafe { region.start().add(i * stride) }.cast::<u32>();
                RwLock::new(PageWords { start, words })
            })
            .collect();
        Ok(HostStore { pages, page_bytes, _region: region })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvDtype;

    fn store(head_dim: usize, pages: usize) -> HostStore {
        // 2 layers x K and V x 1 head x `head_dim` f32 x 2 tokens a page.
        let layout = KvLayout { num_layers: 2, num_kv_heads: 1, head_dim, page_size: 2, dtype: KvDtype::F32 };
        HostStore::allocate(&layout, pages).unwrap()
    }

    #[test]
    fn pages_are_zeroed_disjoint_and_cover_their_length() {
        // 2 tokens x 2 layers x K and V x 3 f32: 96-byte pages on 128-byte strides.
        let s = store(3, 100);
        assert_eq!(s.page_bytes(), 96);
        for id in 0..100 {
            assert!(s.read(id).iter().all(|w| *w == 0), "page {id} not zeroed");
            s.write(id).fill(id + 1);
        }
        for id in 0..100 {
            let page = s.read(id);
            assert_eq!(page.len(), 24);
            assert!(page.iter().all(|w| *w == id + 1), "page {id} was overwritten by a neighbour");
        }
    }

    #[test]
    fn huge_pages_of_kv_start_on_huge_page_boundaries() {
        // 2 tokens x 2 layers x K and V x 65536 f32 = 2 MiB a page.
        let s = store(64 * 1024, 3);
        assert_eq!(s.page_bytes(), 2 << 20);
        for id in 0..3 {
            assert_eq!(s.read(id).as_ptr() as usize % (2 << 20), 0, "page {id}");
        }
    }
}
