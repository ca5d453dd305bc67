//! A linear layer's forward pass, choosing the kernel by the number of rows: a decode step's few
//! rows stream the weights once (`cpu::matvec`), a prefill chunk is a matrix product (candle's
//! `gemm`), and a product of a few dozen rows is computed transposed.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::Linear;

use super::host_slice::{slice_of, with_slice};
use super::layer::{Half, Layer};
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
        Layer::Half(h) => project_half(h, x),
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
    let y = with_slice(&x, |xs| with_slice(&w, |ws| skinny(xs, ws, layer.bias(), k)))?;
    Tensor::from_vec(y, (rows, n), &Device::Cpu)
}

/// Up to this many rows a half-precision product streams the stored rows through `matvec`
/// (converted in registers); more are a matrix product over the weight widened once. Widening
/// writes and rereads 4 bytes a weight, so a decode step of 32 streams that widened every weight
/// ran at half the rate of 8 streams (gguf bench, f16); streaming reads 2 bytes a weight per
/// pass of the weight's rows.
pub const HALF_STREAMED_ROWS: usize = 64;

/// A decode step's rows stream the stored half-precision rows; a prefill chunk's many rows are
/// a matrix product, for which widening the weight once costs little.
fn project_half(layer: &Half, x: &Tensor) -> Result<Tensor> {
    let (rows, k) = x.dims2()?;
    let w = layer.weight();
    if rows > HALF_STREAMED_ROWS || !matches!(x.device(), Device::Cpu) || x.dtype() != DType::F32 {
        return project_dense(&layer.widened()?, x);
    }
    let n = w.dim(0)?;
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let bias = layer.bias();
    let y = with_slice(&x, |xs| match w.dtype() {
        DType::F16 => slice_of::<half::f16, _>(&w, |ws| skinny(xs, ws, bias, k)),
        DType::BF16 => slice_of::<half::bf16, _>(&w, |ws| skinny(xs, ws, bias, k)),
        other => candle_core::bail!("a half-precision layer holds {other:?}"),
    })?;
    Tensor::from_vec(y, (rows, n), &Device::Cpu)
}

/// `matvec::skinny` with the bias, if any, read in place.
fn skinny<W: matvec::WeightRows + ?Sized>(xs: &[f32], ws: &W, bias: Option<&Tensor>, k: usize) -> Result<Vec<f32>> {
    match bias {
        Some(b) => with_slice(b, |bs| Ok(matvec::skinny(xs, ws, Some(bs), k))),
        None => Ok(matvec::skinny(xs, ws, None, k)),
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

    /// A half-precision layer gives, at every row count, the bits of its weight widened to f32:
    /// streamed by `matvec` up to `HALF_STREAMED_ROWS` rows, the dense product beyond.
    #[test]
    fn a_half_layer_gives_the_bits_of_its_widened_weight() {
        use candle_core::quantized::{GgmlDType, QTensor};
        let (k, n) = (70, 90);
        let cpu = &Device::Cpu;
        let w = Tensor::from_vec(pseudo(n * k, 4), (n, k), cpu).unwrap();
        let b = Tensor::from_vec(pseudo(n, 5), n, cpu).unwrap();
        for dtype in [GgmlDType::F16, GgmlDType::BF16] {
            let half = Layer::from_qtensor(QTensor::quantize(&w, dtype).unwrap(), Some(b.clone())).unwrap();
            let Layer::Half(h) = &half else { panic!("{dtype:?} was not kept half: {}", half.type_name()) };
            let wide = h.widened().unwrap();
            let dense = Layer::Dense(wide.clone());
            let (wide_w, b) = (wide.weight().flatten_all().unwrap().to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
            let bits = |v: Vec<f32>| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            for rows in [1, matvec::MAX_ROWS, matvec::MAX_ROWS + 1, HALF_STREAMED_ROWS, HALF_STREAMED_ROWS + 1, TRANSPOSED_ROWS + 1] {
                let xs = pseudo(rows * k, 6);
                let x = Tensor::from_vec(xs.clone(), (rows, k), cpu).unwrap();
                let got = bits(project(&half, &x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
                let want = if rows <= HALF_STREAMED_ROWS {
                    matvec::skinny(&xs, &wide_w[..], Some(&b), k)
                } else {
                    project(&dense, &x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
                };
                assert_eq!(got, bits(want), "{dtype:?}, {rows} rows");
            }
        }
    }
}
