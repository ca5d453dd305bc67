//! Page bookkeeping: which pages are free, who owns the others, and at which generation.
//!
//! Plain Rust with no storage and no tensors, so every rule is unit-tested on its own. A page's
//! generation goes up each time it is freed; a reference taken before the free no longer matches
//! and is refused, so freed KV is never readable through a stale reference.

use std::collections::VecDeque;

use thiserror::Error;

/// Who holds a page: one sequence or one handoff reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnerId(pub u64);

/// A page as seen by its owner: the page id and the generation at which it was handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageRef {
    pub id: u32,
    pub generation: u32,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum AllocError {
    #[error("KV pool has {free} free pages, {requested} requested")]
    Insufficient { requested: usize, free: usize },
    #[error("KV pool has {total} pages in all, {requested} requested: it can never fit")]
    NeverFits { requested: usize, total: usize },
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum AccessError {
    #[error("page {page} does not exist")]
    NoSuchPage { page: u32 },
    #[error("page {page} is not owned by {owner:?}")]
    NotOwner { page: u32, owner: OwnerId },
    #[error("page {page} was freed and reused (generation {held} is stale, now {current})")]
    Stale { page: u32, held: u32, current: u32 },
}

#[derive(Debug)]
pub struct PageAllocator {
    /// FIFO so a just-freed page is the last one handed out again.
    free: VecDeque<u32>,
    owner: Vec<Option<OwnerId>>,
    generation: Vec<u32>,
}

impl PageAllocator {
    pub fn new(num_pages: usize) -> Self {
        assert!(num_pages <= u32::MAX as usize, "page ids are u32");
        PageAllocator { free: (0..num_pages as u32).collect(), owner: vec![None; num_pages], generation: vec![0; num_pages] }
    }

    pub fn total(&self) -> usize {
        self.owner.len()
    }

    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    pub fn used_pages(&self) -> usize {
        self.total() - self.free_pages()
    }

    /// Hands `n` pages to `owner`, all or nothing.
    pub fn allocate(&mut self, owner: OwnerId, n: usize) -> Result<Vec<PageRef>, AllocError> {
        if n > self.total() {
            return Err(AllocError::NeverFits { requested: n, total: self.total() });
        }
        if n > self.free.len() {
            return Err(AllocError::Insufficient { requested: n, free: self.free.len() });
        }
        let pages = self
            .free
            .drain(..n)
            .map(|id| {
                self.owner[id as usize] = Some(owner);
                PageRef { id, generation: self.generation[id as usize] }
            })
            .collect();
        Ok(pages)
    }

    /// Checks that `owner` may touch `page` as it holds it now.
    pub fn check(&self, owner: OwnerId, page: PageRef) -> Result<(), AccessError> {
        let i = page.id as usize;
        let Some(current_owner) = self.owner.get(i) else {
            return Err(AccessError::NoSuchPage { page: page.id });
        };
        let current = self.generation[i];
        if page.generation != current {
            return Err(AccessError::Stale { page: page.id, held: page.generation, current });
        }
        if *current_owner != Some(owner) {
            return Err(AccessError::NotOwner { page: page.id, owner });
        }
        Ok(())
    }

    /// Takes `pages` back from `owner`. The caller scrubs them *before* calling this, so a page
    /// is clean by the time anyone can allocate it. Pages not held by `owner` are left alone and
    /// reported.
    pub fn release(&mut self, owner: OwnerId, pages: &[PageRef]) -> Result<(), AccessError> {
        for page in pages {
            self.check(owner, *page)?;
        }
        for page in pages {
            let i = page.id as usize;
            self.owner[i] = None;
            self.generation[i] = self.generation[i].wrapping_add(1);
            self.free.push_back(page.id);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: OwnerId = OwnerId(1);
    const B: OwnerId = OwnerId(2);

    #[test]
    fn allocation_is_all_or_nothing() {
        let mut a = PageAllocator::new(4);
        let got = a.allocate(A, 3).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(a.allocate(B, 2), Err(AllocError::Insufficient { requested: 2, free: 1 }));
        assert_eq!(a.free_pages(), 1, "a failed allocation takes nothing");
        assert_eq!(a.allocate(B, 5), Err(AllocError::NeverFits { requested: 5, total: 4 }));
    }

    #[test]
    fn only_the_owner_may_touch_a_page() {
        let mut a = PageAllocator::new(2);
        let p = a.allocate(A, 1).unwrap()[0];
        assert_eq!(a.check(A, p), Ok(()));
        assert_eq!(a.check(B, p), Err(AccessError::NotOwner { page: p.id, owner: B }));
        assert_eq!(a.release(B, &[p]), Err(AccessError::NotOwner { page: p.id, owner: B }));
        assert_eq!(a.used_pages(), 1, "a refused release frees nothing");
    }

    #[test]
    fn a_freed_page_is_unreadable_through_its_old_reference() {
        let mut a = PageAllocator::new(1);
        let old = a.allocate(A, 1).unwrap()[0];
        a.release(A, &[old]).unwrap();
        let new = a.allocate(B, 1).unwrap()[0];
        assert_eq!(new.id, old.id);
        assert_eq!(a.check(A, old), Err(AccessError::Stale { page: 0, held: 0, current: 1 }));
        assert_eq!(a.check(B, new), Ok(()));
        // The same owner re-allocating does not revive an old reference either.
        a.release(B, &[new]).unwrap();
        let again = a.allocate(A, 1).unwrap()[0];
        assert!(a.check(A, old).is_err());
        assert_eq!(a.check(A, again), Ok(()));
    }

    #[test]
    fn double_release_is_refused() {
        let mut a = PageAllocator::new(2);
        let p = a.allocate(A, 2).unwrap();
        a.release(A, &p).unwrap();
        assert!(a.release(A, &p).is_err());
        assert_eq!(a.free_pages(), 2);
    }

    #[test]
    fn freed_pages_go_to_the_back_of_the_queue() {
        let mut a = PageAllocator::new(3);
        let first = a.allocate(A, 1).unwrap();
        a.release(A, &first).unwrap();
        let next = a.allocate(B, 2).unwrap();
        assert!(next.iter().all(|p| p.id != first[0].id));
    }

    #[test]
    fn unknown_page_ids_are_reported() {
        let a = PageAllocator::new(1);
        assert_eq!(a.check(A, PageRef { id: 7, generation: 0 }), Err(AccessError::NoSuchPage { page: 7 }));
    }
}
