//! The paged KV pool: layout, page bookkeeping, storage, sizing and the attention that reads it.

pub mod allocator;
pub mod attention;
#[cfg(feature = "cuda")]
pub mod cuda_store;
pub mod element;
pub mod host_region;
mod host_store;
pub mod layout;
pub mod pool;
pub mod sizing;
pub mod store;

pub use allocator::{AllocError, OwnerId, PageRef};
pub use attention::{AttnShape, Scratch};
pub use layout::{Half, KvDtype, KvLayout};
pub use pool::{KvError, KvPool, Lease};
pub use sizing::PoolSize;
pub use store::{PageRead, PageStore, StoreError};
