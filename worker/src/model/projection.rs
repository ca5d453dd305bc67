//! A linear layer's forward pass, choosing the kernel by the number of rows: a decode step's few
//! rows stream the weights once (`cpu::matvec`), a prefill chunk is a matrix product (candle's
//! `gemm`), and a product of a few dozen rows is computed transposed.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::Linear;

use super::layer::Layer;
use crate::cpu::matvec;

/// Up to this many rows a matrix product is computed as `(W x^T)^T`. `gemm`'s AVX-512 kernels
/// work on tiles of up to 64 rows of the left operand, so `x W^T` with a few dozen rows leaves
/// lanes idle and ran slower than its AVX2 kernels (on the bench model a 24-token prefill at
/// 0.65x); transposed, the tiles run over the weight's outputs, which are many: 1.56x at 64 rows,
/// 1.20x at 128, 0.97x at 256, and with the AVX2 kernels within the noise either way.
const TRANSPOSED_ROWS: usize = 128;

/// `x W^T + b` for `x` `[rows, in]`.
pub fn project(layer: &Layer, x: &Tensor) -> Result<Tensor> {
    match layer {
        Layer::Dense(l) => project_dense(l, x),
        Layer::Quantized(q) => q.forward(x),
        Layer::Parts(parts) => Tensor::cat(&parts.iter().map(|p| project(p, x)).collect::<Result<Vec<_>>>()?, 1),
    }
}

fn project_dense(layer: &Linear, x: &Tensor) -> Result<Tensor> {
    let (rows, k) = x.dims2()?;
    let w = layer.weight();
    if rows > TRANSPOSED_ROWS || !matches!(x.device(), Device::Cpu) || x.dtype() != DType::F32 || w.dtype() != DType::F32 {
        return layer.forward(x);
    }
    if rows > matvec::MAX_ROWS {
        let y = w.matmul(&x.t()?)?.t()?.contiguous()?;
        return match layer.bias() {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        };
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
pub(crate) fn with_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (candle_core::Storage::Cpu(cpu), Some((start, end))) => f(&cpu.as_slice::<f32>()?[start..end]),
        _ => candle_core::bail!("expected a contiguous f32 tensor in host memory"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_data::pseudo;

    /// Whichever kernel a row count takes, the result is `x W^T + b` as candle's plain product
    /// gives it.
    #[test]
    fn every_row_count_gives_the_plain_product() {
        let (k, n) = (70, 90);
        let cpu = &Device::Cpu;
        let w = Tensor::from_vec(pseudo(n * k, 1), (n, k), cpu).unwrap();
        let b = Tensor::from_vec(pseudo(n, 2), n, cpu).unwrap();
        for layer in [Linear::new(w.clone(), None), Linear::new(w, Some(b))] {
            for rows in [1, matvec::MAX_ROWS, matvec::MAX_ROWS + 1, TRANSPOSED_ROWS, TRANSPOSED_ROWS + 1] {
                let x = Tensor::from_vec(pseudo(rows * k, 3), (rows, k), cpu).unwrap();
                let (got, want) = (project(&Layer::Dense(layer.clone()), &x).unwrap(), layer.forward(&x).unwrap());
                assert_eq!(got.dims(), want.dims(), "{rows} rows");
                let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(diff < 1e-4, "{rows} rows: off by {diff}");
            }
        }
    }
}
