//! A tensor's elements in host memory, read in place (no copy of weights or bias on a decode
//! step).

use candle_core::{Result, Tensor};

/// Runs `f` over a contiguous CPU f32 tensor's elements in place (no copy of weights or bias on
/// a decode step).
pub(crate) fn with_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    slice_of(t, f)
}

/// `with_slice` for a tensor of elements `T`.
pub(crate) fn slice_of<T: candle_core::WithDType, R>(t: &Tensor, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (candle_core::Storage::Cpu(cpu), Some((start, end))) => f(&cpu.as_slice::<T>()?[start..end]),
        _ => candle_core::bail!("expected a contiguous {:?} tensor in host memory", T::DTYPE),
    }
}
