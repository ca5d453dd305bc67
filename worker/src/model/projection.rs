//! A linear layer's forward pass, choosing the kernel by the number of rows: a decode step's few
//! rows stream the weights once (`cpu::matvec`), a prefill chunk is a matrix product (candle's
//! `gemm`).

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::Linear;

use crate::cpu::matvec;

/// `x W^T + b` for `x` `[rows, in]`.
pub fn project(layer: &Linear, x: &Tensor) -> Result<Tensor> {
    let (rows, k) = x.dims2()?;
    let w = layer.weight();
    if rows > matvec::MAX_ROWS || !matches!(x.device(), Device::Cpu) || x.dtype() != DType::F32 || w.dtype() != DType::F32 {
        return layer.forward(x);
    }
    let n = w.dim(0)?;
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let y = with_slice(&x, |xs| {
        with_slice(&w, |ws| match layer.bias() {
            Some(b) => with_slice(b, |bs| Ok(matvec::skinny(xs, ws, Some(bs), k))),
            None => Ok(matvec::skinny(xs, ws, None, k)),
        })
    })?;
    Tensor::from_vec(y, (rows, n), &Device::Cpu)
}

/// Runs `f` over a contiguous CPU f32 tensor's elements in place (no copy of weights or bias on
/// a decode step).
fn with_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (candle_core::Storage::Cpu(cpu), Some((start, end))) => f(&cpu.as_slice::<f32>()?[start..end]),
        _ => candle_core::bail!("expected a contiguous f32 tensor in host memory"),
    }
}
