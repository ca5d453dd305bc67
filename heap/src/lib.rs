//! glibc allocator tuning shared by the worker and the operator. Each call is a no-op off glibc.

mod step_buffers;
mod trim;

pub use step_buffers::keep_step_buffers;
pub use trim::{give_back_freed_memory, one_arena};
