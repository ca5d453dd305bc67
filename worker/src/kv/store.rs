//! Where page bytes live: host memory, or CUDA device memory with the `cuda` feature. Every call
//! takes `&self`: a page is locked for the length of one read or write, never the whole store.

use std::ops::Deref;
use std::sync::RwLockReadGuard;

use thiserror::Error;

use super::KvLayout;
use super::host_store::{self, HostStore, PageWords};

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("a pool of {pages} pages overflows the address space")]
    TooLarge { pages: usize },
    #[error("could not allocate {bytes} bytes of host memory for the KV pool")]
    OutOfMemory { bytes: u64 },
    #[error("CUDA: {0}")]
    Cuda(String),
}

pub enum PageStore {
    Host(HostStore),
    /// Device copies go through one stream, so one at a time.
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Mutex<super::cuda_store::CudaStore>),
}

/// One page's bytes as read: in place under the page's read lock, or copied from the device.
pub enum PageRead<'a> {
    Host(RwLockReadGuard<'a, PageWords>, usize),
    #[cfg(feature = "cuda")]
    Copied(Vec<u32>, usize),
}

impl Deref for PageRead<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            PageRead::Host(words, len) => host_store::bytes(words, *len),
            #[cfg(feature = "cuda")]
            PageRead::Copied(words, len) => host_store::bytes(words, *len),
        }
    }
}

impl PageStore {
    pub fn host(layout: &KvLayout, num_pages: usize) -> Result<Self, StoreError> {
        Ok(PageStore::Host(HostStore::allocate(layout, num_pages)?))
    }

    #[cfg(feature = "cuda")]
    pub fn cuda(store: super::cuda_store::CudaStore) -> Self {
        PageStore::Cuda(std::sync::Mutex::new(store))
    }

    pub fn in_host_memory(&self) -> bool {
        matches!(self, PageStore::Host(_))
    }

    /// The bytes of page `id`, held until the returned value is dropped.
    pub fn read(&self, id: u32) -> Result<PageRead<'_>, StoreError> {
        match self {
            PageStore::Host(h) => Ok(PageRead::Host(h.read(id), h.page_bytes())),
            #[cfg(feature = "cuda")]
            PageStore::Cuda(c) => {
                let c = c.lock().unwrap_or_else(|p| p.into_inner());
                let mut words = vec![0u32; c.page_bytes().div_ceil(4)];
                c.read_page(id, &mut bytemuck::cast_slice_mut(&mut words)[..c.page_bytes()])?;
                Ok(PageRead::Copied(words, c.page_bytes()))
            }
        }
    }

    /// Fills `len` bytes of page `id` from byte `offset` with `fill` (in place in host memory).
    pub fn write_with(&self, id: u32, offset: usize, len: usize, fill: impl FnOnce(&mut [u8])) -> Result<(), StoreError> {
        match self {
            PageStore::Host(h) => {
                let mut page = h.write(id);
                fill(&mut host_store::bytes_mut(&mut page, h.page_bytes())[offset..offset + len]);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            PageStore::Cuda(c) => {
                let mut bytes = vec![0u8; len];
                fill(&mut bytes);
                c.lock().unwrap_or_else(|p| p.into_inner()).write(id, offset, &bytes)
            }
        }
    }

    /// `fill` over page `id` from byte `offset` to its end, in place; `None` (and `fill` not
    /// called) where pages are on a device.
    pub fn fill_host<R>(&self, id: u32, offset: usize, fill: impl FnOnce(&mut [u8]) -> R) -> Option<R> {
        match self {
            PageStore::Host(h) => {
                let mut page = h.write(id);
                Some(fill(&mut host_store::bytes_mut(&mut page, h.page_bytes())[offset..]))
            }
            #[cfg(feature = "cuda")]
            PageStore::Cuda(_) => None,
        }
    }

    /// Overwrites `bytes.len()` bytes of page `id` from byte `offset`.
    pub fn write(&self, id: u32, offset: usize, bytes: &[u8]) -> Result<(), StoreError> {
        self.write_with(id, offset, bytes.len(), |out| out.copy_from_slice(bytes))
    }

    /// Zeroes page `id`.
    pub fn scrub(&self, id: u32) -> Result<(), StoreError> {
        match self {
            PageStore::Host(h) => {
                h.write(id).fill(0);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            PageStore::Cuda(c) => c.lock().unwrap_or_else(|p| p.into_inner()).scrub(id),
        }
    }
}
