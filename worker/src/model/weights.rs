//! Where `Llama::load` gets each weight, by the checkpoint's name for it: a safetensors
//! checkpoint (f16 and bf16 projections and embeddings as stored, everything else widened to
//! f32 as it is read) or a GGUF file (as stored, under llama.cpp's names).

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Result};
use candle_nn::{Embedding, Linear, RmsNorm, VarBuilder};

use super::gguf::Gguf;
use super::layer::{Embed, Layer};

pub enum Weights<'a> {
    /// `vb` reads every tensor widened to f32; `stored` says which the files hold half
    /// (empty for the built-in model).
    Safetensors {
        vb: VarBuilder<'a>,
        stored: HashMap<String, DType>,
    },
    Gguf(&'a Gguf),
}

/// llama.cpp's name for a tensor the checkpoint names `hf` (without `.weight`).
pub fn gguf_name(hf: &str) -> String {
    let fixed = [("model.embed_tokens", "token_embd"), ("model.norm", "output_norm"), ("lm_head", "output")];
    if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
        return (*g).to_string();
    }
    let Some((layer, part)) = hf.strip_prefix("model.layers.").and_then(|r| r.split_once('.')) else { return hf.to_string() };
    let part = match part {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        other => other,
    };
    format!("blk.{layer}.{part}")
}

fn gguf_err(e: super::ModelError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

impl Weights<'_> {
    pub fn device(&self) -> Device {
        match self {
            Weights::Safetensors { vb, .. } => vb.device().clone(),
            Weights::Gguf(_) => Device::Cpu,
        }
    }

    /// `name`'s `[outputs, inputs]` weight and, with `bias`, its bias.
    pub fn linear(&self, name: &str, inputs: usize, outputs: usize, bias: bool) -> Result<Layer> {
        match self {
            Weights::Safetensors { vb, stored } => {
                let half = half_stored(vb, stored, &format!("{name}.weight"));
                let vb = vb.pp(name);
                let b = if bias { Some(vb.get(outputs, "bias")?) } else { None };
                match half {
                    Some(dtype) => Layer::half(vb.get_with_hints_dtype((outputs, inputs), "weight", Default::default(), dtype)?, b),
                    None => Ok(Layer::Dense(Linear::new(vb.get((outputs, inputs), "weight")?, b))),
                }
            }
            Weights::Gguf(g) => {
                let base = gguf_name(name);
                let w = g.tensor(&format!("{base}.weight")).map_err(gguf_err)?;
                if w.shape().dims() != [outputs, inputs] {
                    candle_core::bail!("GGUF tensor `{base}.weight` is {:?}, the configuration asks for [{outputs}, {inputs}]", w.shape().dims());
                }
                let b = if bias { Some(g.tensor(&format!("{base}.bias")).map_err(gguf_err)?.dequantize(&Device::Cpu)?) } else { None };
                Layer::from_qtensor(w, b)
            }
        }
    }

    pub fn norm(&self, name: &str, size: usize, eps: f64) -> Result<RmsNorm> {
        match self {
            Weights::Safetensors { vb, .. } => candle_nn::rms_norm(size, eps, vb.pp(name)),
            Weights::Gguf(g) => {
                let w = g.tensor(&format!("{}.weight", gguf_name(name))).map_err(gguf_err)?.dequantize(&Device::Cpu)?;
                Ok(RmsNorm::new(w, eps))
            }
        }
    }

    pub fn embedding(&self, name: &str, vocab: usize, hidden: usize) -> Result<Embed> {
        match self {
            Weights::Safetensors { vb, stored } => match half_stored(vb, stored, &format!("{name}.weight")) {
                Some(dtype) => Ok(Embed::Half(vb.pp(name).get_with_hints_dtype((vocab, hidden), "weight", Default::default(), dtype)?)),
                None => Ok(Embed::Dense(candle_nn::embedding(vocab, hidden, vb.pp(name))?)),
            },
            Weights::Gguf(g) => {
                let base = gguf_name(name);
                let t = g.tensor(&format!("{base}.weight")).map_err(gguf_err)?;
                if t.shape().dims() != [vocab, hidden] {
                    candle_core::bail!("GGUF tensor `{base}.weight` is {:?}, the configuration asks for [{vocab}, {hidden}]", t.shape().dims());
                }
                Ok(match t.dtype() {
                    GgmlDType::F32 => Embed::Dense(Embedding::new(t.dequantize(&Device::Cpu)?, hidden)),
                    _ => Embed::Quantized(Arc::new(t)),
                })
            }
        }
    }
}

/// The half type `name` is stored in, where it is kept so: on the CPU, whose kernels read half
/// rows (a model computed elsewhere is widened as before).
fn half_stored(vb: &VarBuilder, stored: &HashMap<String, DType>, name: &str) -> Option<DType> {
    stored.get(name).copied().filter(|d| matches!(d, DType::F16 | DType::BF16) && vb.device().is_cpu())
}
