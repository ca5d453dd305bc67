//! The model's configuration, resolved: every field that changes the computation has its value
//! here. `config_reader` fills it from a `config.json` in either layout `transformers` writes.

use serde::{Deserialize, Serialize};

use super::ModelError;

/// Architectures whose weights follow the Llama layout this worker implements.
pub(crate) const SUPPORTED: &[&str] = &["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"];

/// The model families this worker implements: each has its own defaults and its own rules (biases,
/// sliding windows), decided once from `config.json`'s `model_type` (or its architecture) or a
/// GGUF file's `general.architecture`, then matched, never compared as text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    /// Written as `model_type`, as `config.json` names it.
    #[serde(rename = "model_type")]
    pub family: Family,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Llama's switch for q/k/v/o biases; Qwen2 always has q/k/v biases.
    #[serde(default)]
    pub attention_bias: bool,
    /// Llama's switch for gate/up/down biases.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mlp_bias: bool,
    /// Attention sees at most this many positions (itself included) on the layers `layer_types`
    /// marks `sliding_attention`, or on every layer when `layer_types` is absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
}

/// `eos_token_id` is a number in some configs and a list in others.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

/// RoPE frequency scaling: `linear` (positions divided by `factor`) or Llama 3's long-context
/// scaling.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    #[serde(default)]
    pub factor: Option<f64>,
    #[serde(default)]
    pub low_freq_factor: Option<f64>,
    #[serde(default)]
    pub high_freq_factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10_000.0
}

impl ModelConfig {
    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    pub fn qkv_bias(&self) -> bool {
        self.attention_bias || self.is_qwen2()
    }

    /// Only Llama's `attention_bias` gives `o_proj` a bias (the reader refuses it elsewhere).
    pub fn o_bias(&self) -> bool {
        self.attention_bias
    }

    /// How many positions (itself included) a token of `layer` attends to; `None` = all.
    pub fn window(&self, layer: usize) -> Option<usize> {
        match &self.layer_types {
            Some(types) => self.sliding_window.filter(|_| types.get(layer).is_some_and(|t| t == "sliding_attention")),
            None => self.sliding_window,
        }
    }

    pub(crate) fn is_qwen2(&self) -> bool {
        self.family == Family::Qwen2
    }

    pub fn eos_ids(&self) -> Vec<u32> {
        match &self.eos_token_id {
            Some(TokenIds::One(id)) => vec![*id],
            Some(TokenIds::Many(ids)) => ids.clone(),
            None => vec![],
        }
    }

    pub fn validate(&self) -> Result<(), ModelError> {
        if let Some(arch) = self.architectures.iter().find(|a| !SUPPORTED.contains(&a.as_str())) {
            return Err(ModelError::UnsupportedArchitecture { found: arch.clone(), supported: SUPPORTED.join(", ") });
        }
        let heads = self.num_attention_heads;
        if heads == 0 || self.num_kv_heads() == 0 || !heads.is_multiple_of(self.num_kv_heads()) {
            return Err(ModelError::Config(format!(
                "num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads ({})",
                self.num_kv_heads()
            )));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(ModelError::Config(format!("head_dim ({}) must be even for rotary embeddings", self.head_dim())));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN2: &str = r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":896,"intermediate_size":4864,
        "num_hidden_layers":24,"num_attention_heads":14,"num_key_value_heads":2,"vocab_size":151936,
        "rms_norm_eps":1e-6,"rope_theta":1000000.0,"tie_word_embeddings":true,"eos_token_id":151643}"#;

    const LLAMA3: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":2048,"intermediate_size":8192,
        "num_hidden_layers":16,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,
        "rope_theta":500000.0,"rope_scaling":{"factor":32.0,"high_freq_factor":4.0,"low_freq_factor":1.0,
        "original_max_position_embeddings":8192,"rope_type":"llama3"},"eos_token_id":[128001,128008,128009]}"#;

    #[test]
    fn qwen2_config_has_qkv_bias_and_gqa() {
        let c = ModelConfig::from_json(QWEN2).unwrap();
        assert!(c.qkv_bias());
        assert_eq!((c.num_kv_heads(), c.head_dim()), (2, 64));
        assert_eq!(c.eos_ids(), vec![151643]);
    }

    #[test]
    fn llama3_config_reads_scaling_and_eos_list() {
        let c = ModelConfig::from_json(LLAMA3).unwrap();
        assert!(!c.qkv_bias());
        assert_eq!(c.rope_scaling.as_ref().unwrap().factor, Some(32.0));
        assert_eq!(c.eos_ids(), vec![128001, 128008, 128009]);
    }

    #[test]
    fn unsupported_architecture_is_named() {
        let text = QWEN2.replace("Qwen2ForCausalLM", "GPT2LMHeadModel");
        let err = ModelConfig::from_json(&text).unwrap_err().to_string();
        assert!(err.contains("GPT2LMHeadModel") && err.contains("LlamaForCausalLM"), "{err}");
    }

    #[test]
    fn missing_field_is_named() {
        let err = ModelConfig::from_json(r#"{"hidden_size":8}"#).unwrap_err().to_string();
        assert!(err.contains("intermediate_size"), "{err}");
    }
}
