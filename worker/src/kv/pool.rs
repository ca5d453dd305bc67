//! The paged KV pool: bookkeeping behind a short lock, page bytes behind one lock each, and
//! leases that give pages back (scrubbed) when dropped.
//!
//! Nothing here is locked for longer than one page copy or one bookkeeping update: a model step
//! over the running sequences, a handoff filling a reservation's pages and a sender reading a
//! finished prefill's pages run side by side. Which pages a caller may touch is settled by its
//! lease (pages are released only when their lease is dropped), checked against the allocator's
//! owner and generation once per step or per handoff page.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use prometheus::{Gauge, IntGauge};

use thiserror::Error;

use super::allocator::{AccessError, AllocError, OwnerId, PageAllocator, PageRef};
use super::attention::{self, AttnShape, Scratch};
use super::element;
use super::store::{PageRead, PageStore, StoreError};
use super::{Half, KvLayout};

#[derive(Debug, Error)]
pub enum KvError {
    #[error(transparent)]
    Access(#[from] AccessError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("position {pos} is past the {capacity} tokens leased")]
    PastLease { pos: usize, capacity: usize },
    #[error("the lease is from another KV pool")]
    ForeignLease,
}

/// The gauges a pool keeps equal to its usage (pages, tokens, and the fraction of pages in use
/// an endpoint picker reads).
#[derive(Clone)]
pub struct UsageGauges {
    pub pages_in_use: IntGauge,
    pub used_tokens: IntGauge,
    pub usage_ratio: Gauge,
}

pub struct KvPool {
    layout: KvLayout,
    device: String,
    num_pages: usize,
    scrub_on_free: bool,
    next_owner: AtomicU64,
    alloc: Mutex<PageAllocator>,
    store: PageStore,
    /// Pages-in-use and used-tokens gauges, kept true at every lease and release.
    usage: OnceLock<UsageGauges>,
    /// Woken whenever pages are released, for callers waiting for room.
    freed: tokio::sync::Notify,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool").field("layout", &self.layout).field("num_pages", &self.num_pages).finish()
    }
}

impl KvPool {
    /// Panics on a layout its dtype cannot store (`KvLayout::check`; start-up refuses those
    /// first, naming the flag): a `q8_0` row of partial blocks would lose its tail silently.
    pub fn new(layout: KvLayout, store: PageStore, num_pages: usize, device: String, scrub_on_free: bool) -> Arc<Self> {
        if let Err(e) = layout.check() {
            panic!("{e}");
        }
        Arc::new(KvPool {
            layout,
            device,
            num_pages,
            scrub_on_free,
            next_owner: AtomicU64::new(1),
            alloc: Mutex::new(PageAllocator::new(num_pages)),
            store,
            usage: OnceLock::new(),
            freed: tokio::sync::Notify::new(),
        })
    }

    /// A pool in host memory, committed now.
    pub fn host(layout: KvLayout, num_pages: usize) -> Result<Arc<Self>, StoreError> {
        let store = PageStore::host(&layout, num_pages)?;
        Ok(Self::new(layout, store, num_pages, "cpu".into(), true))
    }

    /// The same pool, but freed pages keep their bytes (the generation check still guards them).
    /// Only valid before any lease is taken.
    pub fn without_scrub(self: Arc<Self>) -> Arc<Self> {
        let mut this = Arc::try_unwrap(self).expect("without_scrub before the pool is shared");
        this.scrub_on_free = false;
        Arc::new(this)
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn device(&self) -> &str {
        &self.device
    }

    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Measured capacity: tokens in the pages that were really allocated.
    pub fn capacity_tokens(&self) -> usize {
        self.num_pages * self.layout.page_size
    }

    pub fn used_pages(&self) -> usize {
        self.alloc().used_pages()
    }

    pub fn free_pages(&self) -> usize {
        self.alloc().free_pages()
    }

    /// From now on, keeps the gauges equal to the pool's usage.
    pub fn report_usage_to(&self, gauges: UsageGauges) {
        let _ = self.usage.set(gauges);
        self.publish(self.alloc().used_pages());
    }

    fn publish(&self, used_pages: usize) {
        if let Some(g) = self.usage.get() {
            g.pages_in_use.set(used_pages as i64);
            g.used_tokens.set((used_pages * self.layout.page_size) as i64);
            g.usage_ratio.set(used_pages as f64 / self.num_pages().max(1) as f64);
        }
    }

    /// Leases pages for `tokens` tokens to a new owner, all or nothing.
    pub fn lease(self: &Arc<Self>, tokens: usize) -> Result<Lease, AllocError> {
        let owner = OwnerId(self.next_owner.fetch_add(1, Ordering::Relaxed));
        let mut alloc = self.alloc();
        let pages = alloc.allocate(owner, self.layout.pages_for(tokens))?;
        self.publish(alloc.used_pages());
        Ok(Lease { pool: Arc::clone(self), owner, pages, tokens })
    }

    /// Resolves the next time pages are released. Create it *before* trying to lease, so a
    /// release in between is not missed.
    pub fn freed(&self) -> tokio::sync::futures::Notified<'_> {
        self.freed.notified()
    }

    fn alloc(&self) -> MutexGuard<'_, PageAllocator> {
        // A panic while holding the lock leaves bookkeeping consistent (every update is a
        // single assignment), so a poisoned lock is still usable.
        self.alloc.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn release(&self, owner: OwnerId, pages: &[PageRef]) {
        if self.scrub_on_free {
            // Scrub only what this owner really holds (the release below reports the rest). No
            // one else can take these pages before the release, so the bookkeeping lock is not
            // held while a whole sequence's pages are zeroed.
            let held: Vec<PageRef> = {
                let alloc = self.alloc();
                pages.iter().copied().filter(|p| alloc.check(owner, *p).is_ok()).collect()
            };
            for p in held {
                if let Err(e) = self.store.scrub(p.id) {
                    tracing::error!(page = p.id, error = %e, "failed to scrub KV page");
                }
            }
        }
        let mut alloc = self.alloc();
        if let Err(e) = alloc.release(owner, pages) {
            tracing::error!(error = %e, "KV page release refused");
        }
        self.publish(alloc.used_pages());
        drop(alloc);
        self.freed.notify_waiters();
    }

    /// Checks that every page of `lease` is still its own at the generation it was given (and
    /// from this pool): once per model step, before its reads and writes go by page id.
    pub fn verify(&self, lease: &Lease) -> Result<(), KvError> {
        self.own(lease)?;
        let alloc = self.alloc();
        Ok(lease.pages.iter().try_for_each(|p| alloc.check(lease.owner, *p))?)
    }

    fn own(&self, lease: &Lease) -> Result<(), KvError> {
        if std::ptr::eq(Arc::as_ptr(&lease.pool), self) { Ok(()) } else { Err(KvError::ForeignLease) }
    }

    /// Stores one token's K and V for `layer` at sequence position `pos`.
    pub fn write_token(&self, lease: &Lease, pos: usize, layer: usize, k: &[f32], v: &[f32]) -> Result<(), KvError> {
        let page = lease.page_at(pos)?;
        let slot = pos % self.layout.page_size;
        let n = self.layout.token_elems();
        let len = self.layout.row_bytes();
        for (half, values) in [(Half::K, k), (Half::V, v)] {
            let offset = self.layout.slot_offset(layer, half, slot);
            self.store.write_with(page.id, offset, len, |out| element::encode(self.layout.dtype, &values[..n], out))?;
        }
        Ok(())
    }

    /// Attention of one query token over positions `ctx` of `lease` in `layer`, read page by page
    /// through the lease's page table, for the query heads of K/V heads `kv_heads` (`q` and `out`:
    /// `[heads][head_dim]` of those heads; `attention::attend`).
    // The hot loop's inputs, passed flat on purpose (no per-call struct to build).
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        lease: &Lease,
        layer: usize,
        ctx: Range<usize>,
        shape: AttnShape,
        kv_heads: Range<usize>,
        q: &[f32],
        out: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<(), KvError> {
        if ctx.end > lease.capacity() {
            return Err(KvError::PastLease { pos: ctx.end, capacity: lease.capacity() });
        }
        debug_assert!(!ctx.is_empty(), "attention over no positions");
        let l = self.layout;
        let row = l.row_bytes();
        let (k_off, v_off) = (l.block_offset(layer, Half::K), l.block_offset(layer, Half::V));
        // The pages in `ctx`, each held for reading until the kernel is done (device pages are
        // copied to host first).
        let pages = ctx.start / l.page_size..l.pages_for(ctx.end);
        let held: Vec<PageRead> = pages.clone().map(|i| self.store.read(lease.pages[i].id)).collect::<Result<_, _>>()?;
        let blocks = held.iter().zip(pages).map(|(page, i)| {
            // The slots of page `i` inside `ctx`: a sliding window starts mid-page.
            let first = ctx.start.saturating_sub(i * l.page_size).min(l.page_size);
            let end = (ctx.end - i * l.page_size).min(l.page_size);
            let (a, b) = (first * row, end * row);
            (&page[k_off + a..k_off + b], &page[v_off + a..v_off + b], end - first)
        });
        attention::attend(shape, kv_heads, q, l.dtype, blocks, out, scratch);
        Ok(())
    }

    /// K and V of `layer` at positions `ctx` of `lease`, read through its page table as f32
    /// rows `[position][kv_head][head_dim]`: what a multi-token step multiplies its queries with.
    pub fn gather(&self, lease: &Lease, layer: usize, ctx: Range<usize>) -> Result<(Vec<f32>, Vec<f32>), KvError> {
        if ctx.end > lease.capacity() {
            return Err(KvError::PastLease { pos: ctx.end, capacity: lease.capacity() });
        }
        let l = self.layout;
        let row = l.row_bytes();
        let (k_off, v_off) = (l.block_offset(layer, Half::K), l.block_offset(layer, Half::V));
        let elems = ctx.len() * l.token_elems();
        let (mut k, mut v, mut buf) = (Vec::with_capacity(elems), Vec::with_capacity(elems), Vec::new());
        for i in ctx.start / l.page_size..l.pages_for(ctx.end) {
            let first = ctx.start.saturating_sub(i * l.page_size).min(l.page_size) * row;
            let end = (ctx.end - i * l.page_size).min(l.page_size) * row;
            let page = self.store.read(lease.pages[i].id)?;
            k.extend_from_slice(element::decode(l.dtype, &page[k_off + first..k_off + end], &mut buf));
            v.extend_from_slice(element::decode(l.dtype, &page[v_off + first..v_off + end], &mut buf));
        }
        Ok((k, v))
    }

    /// The raw bytes of the lease's `index`-th page (the tests read pages this way).
    #[cfg(test)]
    pub fn page_bytes(&self, lease: &Lease, index: usize) -> Result<Vec<u8>, KvError> {
        let mut out = vec![0u8; self.layout.page_bytes()];
        self.copy_page(lease, index, &mut out)?;
        Ok(out)
    }

    /// Copies the lease's `index`-th page into `out` (exactly a page long): the handoff's
    /// sender stages small pages this way, with no allocation per page.
    pub fn copy_page(&self, lease: &Lease, index: usize, out: &mut [u8]) -> Result<(), KvError> {
        self.read_page(lease, index, |page| out.copy_from_slice(page))
    }

    /// `read` over the lease's `index`-th page, in place under the page's read lock where pages
    /// are in host memory (a device page is copied out first): the handoff's sender tags large
    /// pages and hands them to the socket this way, with no copy of its own.
    pub fn read_page<R>(&self, lease: &Lease, index: usize, read: impl FnOnce(&[u8]) -> R) -> Result<R, KvError> {
        let page = self.owned_page(lease, index * self.layout.page_size)?;
        Ok(read(&self.store.read(page.id)?))
    }

    /// Whether pages live in host memory (read in place), not on a device.
    pub fn in_host_memory(&self) -> bool {
        self.store.in_host_memory()
    }

    /// Overwrites the lease's `index`-th page from byte `offset` with `bytes`.
    pub fn write_page_at(&self, lease: &Lease, index: usize, offset: usize, bytes: &[u8]) -> Result<(), KvError> {
        let page = self.owned_page(lease, index * self.layout.page_size)?;
        self.store.write(page.id, offset, bytes)?;
        Ok(())
    }

    /// Hands `fill` the lease's `index`-th page from byte `offset` to its end, in place, under
    /// the page's write lock: a handoff receiver reads the socket straight into the page this
    /// way, with no copy of its own. `None` where pages are not in host memory (the caller then
    /// stages the bytes and uses [`KvPool::write_page_at`]).
    pub fn fill_host_page<R>(&self, lease: &Lease, index: usize, offset: usize, fill: impl FnOnce(&mut [u8]) -> R) -> Result<Option<R>, KvError> {
        let page = self.owned_page(lease, index * self.layout.page_size)?;
        Ok(self.store.fill_host(page.id, offset, fill))
    }

    /// The page holding `pos`, checked against the allocator (a handoff touches pages one by
    /// one, outside any model step's check).
    fn owned_page(&self, lease: &Lease, pos: usize) -> Result<PageRef, KvError> {
        self.own(lease)?;
        let page = lease.page_at(pos)?;
        self.alloc().check(lease.owner, page)?;
        Ok(page)
    }
}

/// Pages held by one owner for one sequence; returned to the pool, scrubbed, on drop.
pub struct Lease {
    pool: Arc<KvPool>,
    owner: OwnerId,
    pages: Vec<PageRef>,
    tokens: usize,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease").field("owner", &self.owner).field("pages", &self.pages.len()).finish()
    }
}

impl Lease {
    pub fn pages(&self) -> &[PageRef] {
        &self.pages
    }

    /// Tokens this lease was sized for.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Token slots in the leased pages (a multiple of the page size).
    pub fn capacity(&self) -> usize {
        self.pages.len() * self.pool.layout.page_size
    }

    fn page_at(&self, pos: usize) -> Result<PageRef, KvError> {
        self.pages.get(pos / self.pool.layout.page_size).copied().ok_or(KvError::PastLease { pos, capacity: self.capacity() })
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.pool.release(self.owner, &self.pages);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvDtype;

    fn pool(pages: usize) -> Arc<KvPool> {
        let layout = KvLayout { num_layers: 2, num_kv_heads: 1, head_dim: 4, page_size: 2, dtype: KvDtype::F32 };
        KvPool::host(layout, pages).unwrap()
    }

    #[test]
    fn dropping_a_lease_frees_and_scrubs_its_pages() {
        let pool = pool(2);
        let lease = pool.lease(4).unwrap();
        assert_eq!(pool.used_pages(), 2);
        for pos in 0..4 {
            pool.write_token(&lease, pos, 1, &[7.0; 4], &[9.0; 4]).unwrap();
        }
        assert!(pool.page_bytes(&lease, 0).unwrap().iter().any(|b| *b != 0));
        drop(lease);
        assert_eq!(pool.used_pages(), 0);
        let next = pool.lease(4).unwrap();
        for i in 0..2 {
            assert!(pool.page_bytes(&next, i).unwrap().iter().all(|b| *b == 0), "page {i} was not scrubbed");
        }
    }

    #[test]
    fn a_lease_cannot_write_past_its_pages() {
        let pool = pool(4);
        let lease = pool.lease(3).unwrap();
        assert_eq!(lease.capacity(), 4);
        assert!(pool.write_token(&lease, 3, 0, &[1.0; 4], &[1.0; 4]).is_ok());
        assert!(matches!(pool.write_token(&lease, 4, 0, &[1.0; 4], &[1.0; 4]), Err(KvError::PastLease { pos: 4, capacity: 4 })));
    }

    #[test]
    fn attention_reads_only_through_the_page_table() {
        // Two leases interleave their pages; each must see only its own values.
        let pool = pool(4);
        let a = pool.lease(2).unwrap();
        let b = pool.lease(2).unwrap();
        let shape = AttnShape { num_heads: 1, num_kv_heads: 1, head_dim: 4 };
        for pos in 0..2 {
            pool.write_token(&a, pos, 0, &[1.0; 4], &[1.0; 4]).unwrap();
            pool.write_token(&b, pos, 0, &[1.0; 4], &[5.0; 4]).unwrap();
        }
        let mut out = [0.0; 4];
        pool.attend(&a, 0, 0..2, shape, 0..1, &[0.5; 4], &mut out, &mut Scratch::default()).unwrap();
        assert_eq!(out, [1.0; 4]);
        pool.attend(&b, 0, 0..2, shape, 0..1, &[0.5; 4], &mut out, &mut Scratch::default()).unwrap();
        assert_eq!(out, [5.0; 4]);
        assert!(pool.verify(&a).is_ok() && pool.verify(&b).is_ok());
        // A window that starts past position 0 reads only its positions.
        pool.write_token(&a, 1, 0, &[1.0; 4], &[3.0; 4]).unwrap();
        pool.attend(&a, 0, 1..2, shape, 0..1, &[0.5; 4], &mut out, &mut Scratch::default()).unwrap();
        assert_eq!(out, [3.0; 4]);
    }

    #[test]
    fn one_lease_is_written_while_another_is_being_read() {
        // A model step holding a sequence's pages for attention must not stop a handoff
        // filling another lease's pages (the pool has no lock across a step).
        let pool = pool(4);
        let (running, arriving) = (pool.lease(2).unwrap(), pool.lease(2).unwrap());
        let held = pool.store.read(running.pages()[0].id).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| pool.write_page_at(&arriving, 0, 0, &vec![3u8; pool.layout().page_bytes()]).unwrap()).join().unwrap();
        });
        drop(held);
        assert!(pool.page_bytes(&arriving, 0).unwrap().iter().all(|b| *b == 3));
    }

    #[test]
    #[should_panic(expected = "blocks of 32 values")]
    fn a_pool_refuses_a_layout_its_dtype_cannot_store() {
        let layout = KvLayout { num_layers: 1, num_kv_heads: 1, head_dim: 16, page_size: 2, dtype: KvDtype::Q8_0 };
        let _ = KvPool::host(layout, 1);
    }

    #[test]
    fn a_lease_from_another_pool_is_refused() {
        let (a, b) = (pool(2), pool(2));
        let foreign = b.lease(2).unwrap();
        let _own = a.lease(2).unwrap();
        assert!(a.verify(&foreign).is_err());
        assert!(matches!(a.write_page_at(&foreign, 0, 0, &vec![0u8; a.layout().page_bytes()]), Err(KvError::ForeignLease)));
    }
}
