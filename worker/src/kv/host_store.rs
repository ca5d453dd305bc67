//! Page storage in host memory, committed up front.

use super::{KvDtype, KvLayout, StoreError};

/// The pool's bytes in host memory. Backed by a `Vec` of the element type so every page is
/// aligned for typed access.
pub struct HostStore {
    data: HostData,
    page_bytes: usize,
}

enum HostData {
    F32(Vec<f32>),
    Half(Vec<u16>),
}

impl HostStore {
    /// Allocates and *commits* `num_pages` pages: every byte is written once, so the kernel has
    /// really backed the memory and the reported capacity is true, not an overcommit promise.
    pub fn allocate(layout: &KvLayout, num_pages: usize) -> Result<Self, StoreError> {
        let elems = num_pages.checked_mul(layout.page_elems()).ok_or(StoreError::TooLarge { pages: num_pages })?;
        let bytes = elems * layout.dtype.size();
        let data = match layout.dtype {
            KvDtype::F32 => HostData::F32(committed_vec(elems, bytes)?),
            KvDtype::F16 | KvDtype::BF16 => HostData::Half(committed_vec(elems, bytes)?),
        };
        Ok(HostStore { data, page_bytes: layout.page_bytes() })
    }

    fn bytes(&self) -> &[u8] {
        match &self.data {
            HostData::F32(v) => bytemuck::cast_slice(v),
            HostData::Half(v) => bytemuck::cast_slice(v),
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.data {
            HostData::F32(v) => bytemuck::cast_slice_mut(v),
            HostData::Half(v) => bytemuck::cast_slice_mut(v),
        }
    }

    pub fn page(&self, id: u32) -> &[u8] {
        let start = id as usize * self.page_bytes;
        &self.bytes()[start..start + self.page_bytes]
    }

    pub fn page_mut(&mut self, id: u32) -> &mut [u8] {
        let start = id as usize * self.page_bytes;
        let page_bytes = self.page_bytes;
        &mut self.bytes_mut()[start..start + page_bytes]
    }
}

fn committed_vec<T: Copy + Default>(elems: usize, bytes: usize) -> Result<Vec<T>, StoreError> {
    let mut v: Vec<T> = Vec::new();
    v.try_reserve_exact(elems).map_err(|_| StoreError::OutOfMemory { bytes: bytes as u64 })?;
    // `resize` writes every element, faulting in each page of memory now rather than at first use.
    v.resize(elems, T::default());
    Ok(v)
}
