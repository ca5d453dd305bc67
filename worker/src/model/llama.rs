//! The Llama decoder: embeddings, blocks of (RMSNorm, grouped-query attention over the paged
//! pool, RMSNorm, SwiGLU MLP), final norm and LM head. Tensor names follow the checkpoint.

use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::RmsNorm;

use super::chunk_attention::attend_chunk;
use super::config::ModelConfig;
use super::host_slice::with_slice;
use super::layer::{Embed, Layer, stacked};
use super::projection::project;
use super::rope::Rope;
use super::token_attention::{TokenQuery, attend_tokens};
use super::weights::Weights;
use crate::cpu;
use crate::kv::{AttnShape, KvPool, Lease};

/// One sequence's share of a batched step: `tokens` at positions `start..start + tokens.len()`.
#[derive(Debug)]
pub struct SeqStep<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub lease: &'a Lease,
    /// Logits for every token of the step (prompt log-probabilities), not only the last.
    pub every_row: bool,
}

#[derive(Debug, Clone)]
pub(crate) struct Attention {
    /// Q, K and V stacked into one weight: one matrix product over the normed rows instead of
    /// three (wider products keep `gemm`'s tiles fuller, and the rows are read once).
    qkv: Layer,
    /// Output widths of Q and of K (= V).
    q_out: usize,
    kv_out: usize,
    pub(crate) o: Layer,
}

impl Attention {
    /// Q, K and V of `h` (`[n, hidden]`), unrotated.
    pub(crate) fn qkv(&self, h: &Tensor, project: impl Fn(&Layer, &Tensor) -> Result<Tensor>) -> Result<(Tensor, Tensor, Tensor)> {
        let y = project(&self.qkv, h)?;
        Ok((y.narrow(1, 0, self.q_out)?, y.narrow(1, self.q_out, self.kv_out)?, y.narrow(1, self.q_out + self.kv_out, self.kv_out)?))
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub(crate) input_norm: RmsNorm,
    pub(crate) attn: Attention,
    pub(crate) post_norm: RmsNorm,
    /// Gate and up stacked into one weight, as Q, K and V are.
    gate_up: Layer,
    intermediate: usize,
    down: Layer,
}

#[derive(Debug, Clone)]
pub struct Llama {
    pub(crate) cfg: ModelConfig,
    pub(crate) embed: Embed,
    pub(crate) blocks: Vec<Block>,
    pub(crate) norm: RmsNorm,
    pub(crate) lm_head: Layer,
    pub(crate) rope: Rope,
    pub(crate) device: Device,
}

impl Block {
    fn load(cfg: &ModelConfig, w: &Weights, i: usize) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let (q_out, kv_out) = (cfg.num_attention_heads * hd, cfg.num_kv_heads() * hd);
        let bias = cfg.qkv_bias();
        let name = |part: &str| format!("model.layers.{i}.{part}");
        let ffn = cfg.intermediate_size;
        Ok(Block {
            input_norm: w.norm(&name("input_layernorm"), h, cfg.rms_norm_eps)?,
            attn: Attention {
                qkv: stacked(vec![
                    w.linear(&name("self_attn.q_proj"), h, q_out, bias)?,
                    w.linear(&name("self_attn.k_proj"), h, kv_out, bias)?,
                    w.linear(&name("self_attn.v_proj"), h, kv_out, bias)?,
                ])?,
                q_out,
                kv_out,
                o: w.linear(&name("self_attn.o_proj"), q_out, h, cfg.o_bias())?,
            },
            post_norm: w.norm(&name("post_attention_layernorm"), h, cfg.rms_norm_eps)?,
            gate_up: stacked(vec![w.linear(&name("mlp.gate_proj"), h, ffn, cfg.mlp_bias)?, w.linear(&name("mlp.up_proj"), h, ffn, cfg.mlp_bias)?])?,
            intermediate: ffn,
            down: w.linear(&name("mlp.down_proj"), ffn, h, cfg.mlp_bias)?,
        })
    }

    pub(crate) fn mlp(&self, x: &Tensor, project: impl Fn(&Layer, &Tensor) -> Result<Tensor>) -> Result<Tensor> {
        let y = project(&self.gate_up, x)?;
        let gated = match (y.dims2()?, y.device()) {
            ((rows, _), Device::Cpu) if y.dtype() == DType::F32 => {
                let out = with_slice(&y.contiguous()?, |ys| Ok(cpu::silu::silu_mul(ys, self.intermediate)))?;
                Tensor::from_vec(out, (rows, self.intermediate), &Device::Cpu)?
            }
            _ => (y.narrow(1, 0, self.intermediate)?.silu()? * y.narrow(1, self.intermediate, self.intermediate)?)?,
        };
        project(&self.down, &gated)
    }
}

impl Llama {
    pub fn load(cfg: &ModelConfig, w: &Weights) -> Result<Self> {
        let embed = w.embedding("model.embed_tokens", cfg.vocab_size, cfg.hidden_size)?;
        let blocks = (0..cfg.num_hidden_layers).map(|i| Block::load(cfg, w, i)).collect::<Result<Vec<_>>>()?;
        let norm = w.norm("model.norm", cfg.hidden_size, cfg.rms_norm_eps)?;
        let lm_head = if cfg.tie_word_embeddings { embed.as_layer()? } else { w.linear("lm_head", cfg.hidden_size, cfg.vocab_size, false)? };
        Ok(Llama { cfg: cfg.clone(), embed, blocks, norm, lm_head, rope: Rope::new(cfg), device: w.device() })
    }

    /// The types the weights are kept in (`f32`, `q8_0`, `q4k+q4k+q6k` ...), layer by layer
    /// as the first block and the output layer hold them.
    pub fn weight_types(&self) -> String {
        let b = &self.blocks[0];
        format!(
            "qkv {}, o {}, gate/up {}, down {}, output {}",
            b.attn.qkv.type_name(),
            b.attn.o.type_name(),
            b.gate_up.type_name(),
            b.down.type_name(),
            self.lm_head.type_name()
        )
    }

    /// Whether every projection holds its weight in f16 or bf16.
    #[cfg(test)]
    pub fn layers_half(&self) -> bool {
        let half = |l: &Layer| matches!(l, Layer::Half(_));
        self.blocks.iter().all(|b| [&b.attn.qkv, &b.attn.o, &b.gate_up, &b.down].into_iter().all(half)) && half(&self.lm_head)
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub(crate) fn attn_shape(&self) -> AttnShape {
        AttnShape { num_heads: self.cfg.num_attention_heads, num_kv_heads: self.cfg.num_kv_heads(), head_dim: self.cfg.head_dim() }
    }

    /// Rotates `x` (`[n, heads * head_dim]`) by the positions' angles.
    pub(crate) fn rotate(&self, x: &Tensor, heads: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let n = x.dim(0)?;
        let hd = self.cfg.head_dim();
        let x = x.reshape((1, n, heads, hd))?.contiguous()?;
        candle_nn::rotary_emb::rope_thd(&x, cos, sin)?.reshape((n, heads * hd))
    }

    /// Runs one batched step: every sequence's new tokens go through the model together, their
    /// K/V are written into each sequence's own pages, and attention reads back through each
    /// sequence's page table. Returns logits `[rows, vocab]`: one row per sequence (its last
    /// token), or one per token for a step with `every_row`, in step order.
    pub fn forward(&self, steps: &[SeqStep], kv: &KvPool) -> Result<Tensor> {
        let err = |e: crate::kv::KvError| candle_core::Error::Msg(format!("KV pool: {e}"));
        for s in steps {
            kv.verify(s.lease).map_err(err)?;
        }
        let ids: Vec<u32> = steps.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let positions: Vec<u32> = steps.iter().flat_map(|s| (s.start..s.start + s.tokens.len()).map(|p| p as u32)).collect();
        let n = ids.len();
        let shape = self.attn_shape();
        let (q_width, kv_width) = (shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim);
        let (cos, sin) = self.rope.tables(&positions, &self.device)?;

        let mut x = self.embed.forward(&Tensor::from_vec(ids, n, &self.device)?)?;
        let mut out = vec![0.0f32; n * q_width];
        for (layer, block) in self.blocks.iter().enumerate() {
            let window = self.cfg.window(layer);
            let h = block.input_norm.forward(&x)?;
            let (q, k, v) = block.attn.qkv(&h, project)?;
            let q = self.rotate(&q, shape.num_heads, &cos, &sin)?;
            let k = self.rotate(&k, shape.num_kv_heads, &cos, &sin)?;
            let (q, k, v) = (to_vec(&q)?, to_vec(&k)?, to_vec(&v)?);

            let (mut row, mut rest, mut tokens) = (0, out.as_mut_slice(), Vec::new());
            for s in steps {
                let n = s.tokens.len();
                for i in 0..n {
                    let r = row + i;
                    kv.write_token(s.lease, s.start + i, layer, &k[r * kv_width..][..kv_width], &v[r * kv_width..][..kv_width]).map_err(err)?;
                }
                let (mine, tail) = std::mem::take(&mut rest).split_at_mut(n * q_width);
                rest = tail;
                let rows = &q[row * q_width..(row + n) * q_width];
                if n == 1 {
                    // One token: the paged kernel reads its pages in place, after this loop,
                    // with every other one-token sequence's across the compute threads.
                    let end = s.start + 1;
                    tokens.push(TokenQuery { lease: s.lease, ctx: window.map_or(0, |w| end.saturating_sub(w))..end, q: rows, out: mine });
                } else {
                    // A chunk: its queries against the keys gathered once, as matrix products.
                    let end = s.start + n;
                    let first_key = window.map_or(0, |w| (s.start + 1).saturating_sub(w));
                    let (keys, values) = kv.gather(s.lease, layer, first_key..end).map_err(err)?;
                    mine.copy_from_slice(&attend_chunk(shape, rows, &keys, &values, s.start, first_key, window));
                }
                row += n;
            }
            attend_tokens(kv, layer, shape, tokens).map_err(err)?;
            let attn = Tensor::from_slice(&out, (n, q_width), &self.device)?;
            x = (x + project(&block.attn.o, &attn)?)?;
            x = (&x + block.mlp(&block.post_norm.forward(&x)?, project)?)?;
        }
        let last: Vec<u32> = steps
            .iter()
            .scan(0u32, |end, s| {
                let start = *end;
                *end += s.tokens.len() as u32;
                Some(if s.every_row { (start..*end).collect() } else { vec![*end - 1] })
            })
            .flatten()
            .collect();
        let last = x.index_select(&Tensor::new(last.as_slice(), &self.device)?, 0)?;
        project(&self.lm_head, &self.norm.forward(&last)?)?.to_dtype(DType::F32)
    }
}

pub(crate) fn to_vec(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

/// Softmax over the last dimension (kept here so the reference path shares it).
pub(crate) fn softmax_last(t: &Tensor) -> Result<Tensor> {
    candle_nn::ops::softmax(t, D::Minus1)
}
