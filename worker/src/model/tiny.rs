//! The built-in `tiny` model: Llama-shaped, weights drawn from a fixed seed, so it needs no
//! download and produces the same tokens on every machine.

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;

use super::config::{ModelConfig, TokenIds};
use crate::tokenizer::{BOS, EOS};

/// Bumped when the tiny model's shape or weight generator changes (it is part of the fingerprint).
pub const TINY_REVISION: u32 = 1;
const SEED: u64 = 0x6b76_6761_7465_0001;

pub fn config() -> ModelConfig {
    ModelConfig {
        architectures: vec!["LlamaForCausalLM".into()],
        family: super::config::Family::Llama,
        hidden_size: 64,
        intermediate_size: 176,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        head_dim: Some(16),
        vocab_size: 258,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        tie_word_embeddings: false,
        attention_bias: false,
        mlp_bias: false,
        sliding_window: None,
        layer_types: None,
        max_position_embeddings: Some(1 << 21),
        bos_token_id: Some(BOS),
        eos_token_id: Some(TokenIds::One(EOS)),
    }
}

/// Every tensor of the tiny model, as a checkpoint would name them.
pub fn var_builder(device: &Device) -> Result<VarBuilder<'static>> {
    Ok(VarBuilder::from_tensors(tensors(device)?, DType::F32, device))
}

/// The tiny model's weights by checkpoint name (also used to write it out as a checkpoint).
pub fn tensors(device: &Device) -> Result<HashMap<String, Tensor>> {
    let cfg = config();
    let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
    let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_kv_heads() * hd);
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![cfg.vocab_size, h]),
        ("model.norm.weight".into(), vec![h]),
        ("lm_head.weight".into(), vec![cfg.vocab_size, h]),
    ];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        shapes.extend([
            (format!("{p}.input_layernorm.weight"), vec![h]),
            (format!("{p}.post_attention_layernorm.weight"), vec![h]),
            (format!("{p}.self_attn.q_proj.weight"), vec![q, h]),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
            (format!("{p}.self_attn.o_proj.weight"), vec![h, q]),
            (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
            (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
            (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
        ]);
    }
    let mut rng = SplitMix64(SEED);
    let mut tensors = HashMap::new();
    for (name, shape) in shapes {
        let len: usize = shape.iter().product();
        let values: Vec<f32> = if name.ends_with("norm.weight") {
            vec![1.0; len]
        } else {
            // Uniform in +-sqrt(3 / fan_in): unit variance after the projection.
            let scale = (3.0 / *shape.last().unwrap() as f32).sqrt() * if name.contains("embed") { 4.0 } else { 1.0 };
            let mut v: Vec<f32> = (0..len).map(|_| rng.next_unit() * scale).collect();
            if name == "lm_head.weight" {
                // Zero the rows of unprintable bytes so greedy output is readable ASCII.
                for (token, row) in v.chunks_mut(h).enumerate() {
                    if token < 256 && !(0x20..0x7f).contains(&token) && token != b'\n' as usize {
                        row.fill(0.0);
                    }
                }
            }
            v
        };
        tensors.insert(name, Tensor::from_vec(values, shape, device)?);
    }
    Ok(tensors)
}

/// A tiny integer generator: the same bits on every platform, unlike float-based RNGs.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1), exactly representable (24 random bits).
    fn next_unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
}
