//! Page storage in CUDA device memory (feature `cuda`). The driver is loaded at run time, so
//! building needs no CUDA toolkit and a machine without a driver gets a clear error, not a panic.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use super::{KvLayout, PoolSize, StoreError};

pub struct CudaStore {
    stream: Arc<CudaStream>,
    buf: CudaSlice<u8>,
    page_bytes: usize,
    num_pages: usize,
}

fn cuda_err(what: impl std::fmt::Display) -> impl FnOnce(cudarc::driver::DriverError) -> StoreError {
    move |e| StoreError::Cuda(format!("{what}: {e}"))
}

impl CudaStore {
    /// Measures free device memory, sizes the pool from it (or from the explicit size), and
    /// allocates it, zeroed, in one device allocation.
    pub fn allocate(layout: &KvLayout, size: PoolSize, ordinal: usize) -> Result<Self, StoreError> {
        // SAFETY: only probes whether the driver library can be loaded.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(StoreError::Cuda("libcuda (the NVIDIA driver) is not installed on this machine; use --device cpu".into()));
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda_err(format!("opening cuda:{ordinal}")))?;
        let (free, total) = ctx.mem_get_info().map_err(cuda_err("reading device memory"))?;
        let pages = size.pages(layout, || Ok(free as u64)).map_err(|e| StoreError::Cuda(e.to_string()))?;
        let bytes = pages * layout.page_bytes();
        if bytes > free {
            return Err(StoreError::Cuda(format!("a pool of {bytes} bytes ({pages} pages) does not fit the {free} free bytes of cuda:{ordinal}")));
        }
        let stream = ctx.default_stream();
        let buf = stream.alloc_zeros::<u8>(bytes).map_err(cuda_err(format!("allocating {bytes} bytes on cuda:{ordinal}")))?;
        stream.synchronize().map_err(cuda_err("zeroing the pool"))?;
        let (free_after, _) = ctx.mem_get_info().map_err(cuda_err("reading device memory"))?;
        tracing::info!(device = ordinal, total_bytes = total, free_before = free, free_after, pool_bytes = bytes, pages, "KV pool allocated in device memory");
        Ok(CudaStore { stream, buf, page_bytes: layout.page_bytes(), num_pages: pages })
    }

    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Copies page `id` into `out` (exactly a page long).
    pub fn read_page(&self, id: u32, out: &mut [u8]) -> Result<(), StoreError> {
        let start = id as usize * self.page_bytes;
        let view = self.buf.slice(start..start + self.page_bytes);
        self.stream.memcpy_dtoh(&view, out).map_err(cuda_err("reading a page"))?;
        self.stream.synchronize().map_err(cuda_err("reading a page"))
    }

    pub fn write(&mut self, id: u32, offset: usize, bytes: &[u8]) -> Result<(), StoreError> {
        let start = id as usize * self.page_bytes + offset;
        let mut view = self.buf.slice_mut(start..start + bytes.len());
        self.stream.memcpy_htod(bytes, &mut view).map_err(cuda_err("writing a page"))?;
        self.stream.synchronize().map_err(cuda_err("writing a page"))
    }

    pub fn scrub(&mut self, id: u32) -> Result<(), StoreError> {
        let start = id as usize * self.page_bytes;
        let mut view = self.buf.slice_mut(start..start + self.page_bytes);
        self.stream.memset_zeros(&mut view).map_err(cuda_err("scrubbing a page"))?;
        self.stream.synchronize().map_err(cuda_err("scrubbing a page"))
    }
}
