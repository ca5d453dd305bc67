//! The worker's own CPU kernels, compiled for several instruction sets in one binary and chosen
//! at run time (release images run on any x86-64 with AVX2; nothing is built for the build
//! machine's CPU). See `level` for the choice and `KVGATE_CPU_KERNELS` for forcing it down.

pub mod heap;
pub mod lanes;
pub mod level;
pub mod matvec;
pub mod silu;
pub mod softmax;
pub mod threads;

pub use level::{Level, level};
