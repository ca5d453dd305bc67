//! The worker's own CPU kernels, compiled for several instruction sets in one binary and chosen
//! at run time (release images run on any x86-64 with AVX2; nothing is built for the build
//! machine's CPU). See `level` for the choice and `KVGATE_CPU_KERNELS` for forcing it down.

pub mod half_rows;
pub mod lanes;
pub mod level;
pub mod matvec;
pub mod silu;
pub mod softmax;
pub mod threads;
pub mod widen;

pub use level::{Level, level};

/// What a process that runs a model sets first thing in `main`, while it has one thread: the
/// compute threads' count and the heap tuned for model steps. The benches that run the engine
/// in-process call it too, so that they measure it as the worker runs it (without it, candle
/// reads `/proc/cpuinfo` on every matrix product: a tenth of a tiny model's decode).
pub fn prepare_model_process() {
    threads::fix_from_machine();
    kvgate_heap::keep_step_buffers();
}
