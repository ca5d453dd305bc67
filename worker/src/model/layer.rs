//! A linear layer's weight as the checkpoint stores it, and the embedding table. Dense f32
//! weights are multiplied by `projection::project`'s kernels; quantized ones (a GGUF's Q8_0,
//! Q4_K, Q6_K ...) by candle's quantized products, which quantize the rows to 8 bits first, as
//! llama.cpp does, and never widen the weight to f32. f16 and bf16 weights (a GGUF's or a
//! safetensors checkpoint's) stay half (`Half`): a decode step streams them through
//! `cpu::matvec`, converted in registers as they are loaded, and a prefill chunk widens the
//! weight for its one product. Not candle's half-precision product: it reads the whole weight
//! once per input row, with no tiling (a 32-token prompt of a 1B-parameter f16 model took 15 s
//! on two cores that way).

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::quantized::k_quants::{self, BlockQ4K, QK_K};
use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, Linear};

use super::host_slice::{slice_of, with_slice};
use crate::cpu::widen::widen_all;

#[derive(Debug, Clone)]
pub enum Layer {
    Dense(Linear),
    Quantized(Quantized),
    Half(Half),
    /// Parts stored in different types (a Q4_K_M file keeps V in Q6_K beside Q and K in Q4_K),
    /// computed one after another; their outputs are joined as a stacked layer's would be.
    Parts(Vec<Layer>),
}

#[derive(Debug, Clone)]
pub struct Quantized {
    weight: Arc<QTensor>,
    product: QMatMul,
    bias: Option<Tensor>,
}

impl Quantized {
    pub fn new(weight: Arc<QTensor>, bias: Option<Tensor>) -> Result<Self> {
        Ok(Quantized { product: QMatMul::from_arc(weight.clone())?, weight, bias })
    }

    pub fn dtype(&self) -> GgmlDType {
        self.weight.dtype()
    }
}

/// An f16 or bf16 weight (`[outputs, inputs]`) as stored.
#[derive(Debug, Clone)]
pub struct Half {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Half {
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The weight widened to f32, for one product: by the CPU's conversion instructions on
    /// every thread (candle's `to_dtype` converts one element at a time, which halved the
    /// prefill rate of an f16 model).
    pub fn widened(&self) -> Result<Linear> {
        let w = self.weight.contiguous()?;
        let mut wide = vec![0.0f32; w.elem_count()];
        match w.dtype() {
            DType::F16 => slice_of::<half::f16, _>(&w, |s| {
                widen_all(s, &mut wide);
                Ok(())
            })?,
            DType::BF16 => slice_of::<half::bf16, _>(&w, |s| {
                widen_all(s, &mut wide);
                Ok(())
            })?,
            other => candle_core::bail!("a half-precision layer holds {other:?}"),
        }
        Ok(Linear::new(Tensor::from_vec(wide, w.shape(), &Device::Cpu)?, self.bias.clone()))
    }
}

impl Layer {
    /// A weight as the checkpoint stores it: f32 stays dense (the dense kernels are faster than
    /// candle's quantized path for it), f16 and bf16 stay half, every other type stays in its
    /// blocks.
    pub fn from_qtensor(weight: QTensor, bias: Option<Tensor>) -> Result<Layer> {
        Layer::from_arc(Arc::new(weight), bias)
    }

    pub fn from_arc(weight: Arc<QTensor>, bias: Option<Tensor>) -> Result<Layer> {
        let half = match weight.dtype() {
            GgmlDType::F32 => return Ok(Layer::Dense(Linear::new(weight.dequantize(&Device::Cpu)?, bias))),
            GgmlDType::F16 => DType::F16,
            GgmlDType::BF16 => DType::BF16,
            _ => return Ok(Layer::Quantized(Quantized::new(weight, bias)?)),
        };
        Layer::half(Tensor::from_raw_buffer(&weight.data()?, half, weight.shape().dims(), &Device::Cpu)?, bias)
    }

    /// An f16 or bf16 weight kept as it is, with an f32 bias.
    pub fn half(weight: Tensor, bias: Option<Tensor>) -> Result<Layer> {
        if !matches!(weight.dtype(), DType::F16 | DType::BF16) || !weight.device().is_cpu() {
            candle_core::bail!("a half-precision layer takes an f16 or bf16 weight on the CPU, not {:?}", weight.dtype());
        }
        Ok(Layer::Half(Half { weight, bias }))
    }

    /// The weight's type as llama.cpp spells it (`f32`, `q8_0`, `q4_K`; parts joined by `+`).
    pub fn type_name(&self) -> String {
        match self {
            Layer::Dense(l) => format!("{:?}", l.weight().dtype()).to_lowercase(),
            Layer::Quantized(q) => ggml_name(q.dtype()).to_string(),
            Layer::Half(h) => format!("{:?}", h.weight.dtype()).to_lowercase(),
            Layer::Parts(parts) => parts.iter().map(Layer::type_name).collect::<Vec<_>>().join("+"),
        }
    }
}

/// A GGUF tensor type's name as llama.cpp spells it.
pub fn ggml_name(t: GgmlDType) -> &'static str {
    match t {
        GgmlDType::F32 => "f32",
        GgmlDType::F16 => "f16",
        GgmlDType::BF16 => "bf16",
        GgmlDType::Q4_0 => "q4_0",
        GgmlDType::Q4_1 => "q4_1",
        GgmlDType::Q5_0 => "q5_0",
        GgmlDType::Q5_1 => "q5_1",
        GgmlDType::Q8_0 => "q8_0",
        GgmlDType::Q8_1 => "q8_1",
        GgmlDType::Q2K => "q2_K",
        GgmlDType::Q3K => "q3_K",
        GgmlDType::Q4K => "q4_K",
        GgmlDType::Q5K => "q5_K",
        GgmlDType::Q6K => "q6_K",
        GgmlDType::Q8K => "q8_K",
    }
}

/// One layer whose outputs are `parts`' outputs one after another: one product over the rows
/// instead of several (wider products keep the kernels' tiles fuller, and the rows are read
/// once). Dense parts are concatenated; quantized parts of one type too (each output row is
/// quantized on its own, so rows are appended as they are); anything else stays in parts.
pub fn stacked(parts: Vec<Layer>) -> Result<Layer> {
    if let Some(dense) = parts.iter().map(|p| if let Layer::Dense(l) = p { Some(l) } else { None }).collect::<Option<Vec<_>>>() {
        let weights: Vec<&Tensor> = dense.iter().map(|l| l.weight()).collect();
        let biases: Option<Vec<&Tensor>> = dense.iter().map(|l| l.bias()).collect();
        return Ok(Layer::Dense(Linear::new(Tensor::cat(&weights, 0)?, biases.map(|b| Tensor::cat(&b, 0)).transpose()?)));
    }
    let half: Option<Vec<&Half>> = parts.iter().map(|p| if let Layer::Half(h) = p { Some(h) } else { None }).collect();
    if let Some(h) = half.filter(|h| h.iter().all(|x| x.weight.dtype() == h[0].weight.dtype() && x.bias.is_some() == h[0].bias.is_some())) {
        let weights: Vec<&Tensor> = h.iter().map(|x| &x.weight).collect();
        let biases: Option<Vec<&Tensor>> = h.iter().map(|x| x.bias.as_ref()).collect();
        return Ok(Layer::Half(Half { weight: Tensor::cat(&weights, 0)?, bias: biases.map(|b| Tensor::cat(&b, 0)).transpose()? }));
    }
    let quantized: Option<Vec<&Quantized>> = parts.iter().map(|p| if let Layer::Quantized(q) = p { Some(q) } else { None }).collect();
    if let Some(q) = quantized.filter(|q| q.iter().all(|x| x.dtype() == q[0].dtype() && x.bias.is_some() == q[0].bias.is_some())) {
        let cols = q[0].weight.shape().dims2()?.1;
        let mut bytes = Vec::new();
        let mut rows = 0;
        for part in &q {
            let (r, c) = part.weight.shape().dims2()?;
            if c != cols {
                candle_core::bail!("stacking quantized layers of {cols} and {c} inputs");
            }
            bytes.extend_from_slice(&part.weight.data()?);
            rows += r;
        }
        let weight = QTensor::new(QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, q[0].dtype())?, (rows, cols))?;
        let biases: Option<Vec<&Tensor>> = q.iter().map(|x| x.bias.as_ref()).collect();
        return Ok(Layer::Quantized(Quantized::new(Arc::new(weight), biases.map(|b| Tensor::cat(&b, 0)).transpose()?)?));
    }
    Ok(Layer::Parts(parts))
}

impl Module for Layer {
    /// `x W^T + b` by candle's own kernels (the reference path; serving goes through
    /// `projection::project`).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Layer::Dense(l) => l.forward(x),
            Layer::Quantized(q) => q.forward(x),
            Layer::Half(h) => h.widened()?.forward(x),
            Layer::Parts(parts) => Tensor::cat(&parts.iter().map(|p| p.forward(x)).collect::<Result<Vec<_>>>()?, D::Minus1),
        }
    }
}

impl Quantized {
    /// One row against Q4_K blocks as stored, by candle's product over the blocks. Its default
    /// product reads tiles it repacked the blocks into, with f32 scales: 1.4 times the blocks'
    /// bytes, and one row is bound by the bytes it reads. The price: a row's last bits depend on
    /// whether it was alone in its step, as candle's own Q6_K product already does (its tiles
    /// for Q4_K and Q8_0 give the same bits at any row count).
    fn one_row_from_blocks(&self, x: &Tensor) -> Result<Option<Tensor>> {
        if self.dtype() != GgmlDType::Q4K || x.dims2()?.0 != 1 || !x.device().is_cpu() || x.dtype() != DType::F32 {
            return Ok(None);
        }
        let (n, k) = self.weight.shape().dims2()?;
        let data = self.weight.data()?;
        let size = std::mem::size_of::<BlockQ4K>();
        if data.len() != n * k / QK_K * size || !(data.as_ptr() as usize).is_multiple_of(std::mem::align_of::<BlockQ4K>()) {
            candle_core::bail!("a Q4_K weight of {n}x{k} holds {} bytes", data.len());
        }
        // SAFETY: length and alignment checked above; the bytes are the blocks candle stored.
        let blocks = unsafe { std::slice::from_raw_parts(data.as_ptr() as *const BlockQ4K, data.len() / size) };
        let mut y = vec![0.0f32; n];
        with_slice(&x.contiguous()?, |xs| k_quants::matmul((1, k, n), xs, blocks, &mut y))?;
        Ok(Some(Tensor::from_vec(y, (1, n), &Device::Cpu)?))
    }
}

impl Module for Quantized {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match self.one_row_from_blocks(x)? {
            Some(y) => y,
            None => self.product.forward(&x.contiguous()?)?,
        };
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// The token embedding table: dense, or a checkpoint's half or a GGUF's quantized rows looked up
/// without widening the table (an 8B model's 128k x 4096 table would be 2 GiB in f32).
#[derive(Debug, Clone)]
pub enum Embed {
    Dense(Embedding),
    Half(Tensor),
    Quantized(Arc<QTensor>),
}

impl Embed {
    /// The table as an output layer (tied embeddings).
    pub fn as_layer(&self) -> Result<Layer> {
        match self {
            Embed::Dense(e) => Ok(Layer::Dense(Linear::new(e.embeddings().clone(), None))),
            Embed::Half(t) => Layer::half(t.clone(), None),
            Embed::Quantized(q) => Layer::from_arc(q.clone(), None),
        }
    }

    /// The dense table, where there is one.
    pub fn embeddings(&self) -> Option<&Tensor> {
        match self {
            Embed::Dense(e) => Some(e.embeddings()),
            Embed::Half(_) | Embed::Quantized(_) => None,
        }
    }
}

impl Module for Embed {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Embed::Dense(e) => e.forward(ids),
            Embed::Half(t) => t.embedding(ids)?.to_dtype(DType::F32),
            Embed::Quantized(q) => q.embedding(ids),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_data::pseudo;

    /// One row against a Q4_K weight is read from its blocks, several rows from candle's tiles:
    /// the same products, summed with the scales rounded differently, so close (2e-7 of the
    /// largest output when written) but not bit for bit.
    #[test]
    fn one_q4k_row_from_the_blocks_agrees_with_the_tiled_product() {
        let (n, k) = (64, 512);
        let w = Tensor::from_vec(pseudo(n * k, 21), (n, k), &Device::Cpu).unwrap();
        let q = Quantized::new(Arc::new(QTensor::quantize(&w, GgmlDType::Q4K).unwrap()), None).unwrap();
        let xs = pseudo(2 * k, 22);
        let two = Tensor::from_vec(xs.clone(), (2, k), &Device::Cpu).unwrap();
        let tiled = q.forward(&two).unwrap().to_vec2::<f32>().unwrap();
        for (i, want) in tiled.iter().enumerate() {
            let one = Tensor::from_vec(xs[i * k..(i + 1) * k].to_vec(), (1, k), &Device::Cpu).unwrap();
            assert!(q.one_row_from_blocks(&one).unwrap().is_some(), "one row takes the blocks");
            let got = q.forward(&one).unwrap().to_vec2::<f32>().unwrap().remove(0);
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let off = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(off <= 1e-5 * scale, "row {i}: off by {off} of {scale}"); // 2e-7 when written
        }
    }
}
