//! Where page bytes live: host memory, or CUDA device memory with the `cuda` feature.

use thiserror::Error;

use super::KvLayout;
use super::host_store::HostStore;

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
    #[cfg(feature = "cuda")]
    Cuda(super::cuda_store::CudaStore),
}

impl PageStore {
    pub fn host(layout: &KvLayout, num_pages: usize) -> Result<Self, StoreError> {
        Ok(PageStore::Host(HostStore::allocate(layout, num_pages)?))
    }

    /// The bytes of page `id`. Host pages are borrowed in place; device pages are copied into
    /// `scratch` first.
    pub fn page<'a>(&'a self, id: u32, scratch: &'a mut Vec<u8>) -> Result<&'a [u8], StoreError> {
        match self {
            PageStore::Host(h) => {
                let _ = scratch;
                Ok(h.page(id))
            }
            #[cfg(feature = "cuda")]
            PageStore::Cuda(c) => {
                c.read_page(id, scratch)?;
                Ok(scratch.as_slice())
            }
        }
    }

    /// Overwrites `bytes.len()` bytes of page `id` from byte `offset`.
    pub fn write(&mut self, id: u32, offset: usize, bytes: &[u8]) -> Result<(), StoreError> {
        match self {
            PageStore::Host(h) => {
                h.page_mut(id)[offset..offset + bytes.len()].copy_from_slice(bytes);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            PageStore::Cuda(c) => c.write(id, offset, bytes),
        }
    }

    /// Zeroes page `id`.
    pub fn scrub(&mut self, id: u32) -> Result<(), StoreError> {
        match self {
            PageStore::Host(h) => {
                h.page_mut(id).fill(0);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            PageStore::Cuda(c) => c.scrub(id),
        }
    }
}
