//! Reads a `config.json` completely: the layout `transformers` 4 writes (`rope_theta`,
//! `rope_scaling`) and the one `transformers` 5 writes (`rope_parameters`, Qwen2's
//! `layer_types`), with each family's defaults as `transformers` applies them. A field that
//! changes the computation is implemented or refused naming it and its value; a field this
//! reader does not know is refused too, since it cannot tell whether it matters.

use serde_json::{Map, Value};

use super::ModelError;
use super::config::{Family, ModelConfig, RopeScaling, SUPPORTED, TokenIds};

/// Fields that describe training, saving or the Python API, never the forward pass.
const INERT: &[&str] = &[
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "initializer_range",
    "attention_dropout",
    "pad_token_id",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "id2label",
    "label2id",
    "problem_type",
    "tokenizer_class",
    "pretraining_tp",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
];

struct Fields(Map<String, Value>);

fn bad(field: &str, value: &Value, why: &str) -> ModelError {
    ModelError::Config(format!("`{field}` = {value}: {why}"))
}

impl Fields {
    fn take(&mut self, key: &str) -> Option<Value> {
        self.0.remove(key).filter(|v| !v.is_null())
    }

    fn usize(&mut self, key: &str) -> Result<Option<usize>, ModelError> {
        self.take(key).map(|v| v.as_u64().map(|n| n as usize).ok_or_else(|| bad(key, &v, "expected a non-negative integer"))).transpose()
    }

    fn required(&mut self, key: &str) -> Result<usize, ModelError> {
        self.usize(key)?.ok_or_else(|| ModelError::Config(format!("missing field `{key}`")))
    }

    fn f64(&mut self, key: &str) -> Result<Option<f64>, ModelError> {
        self.take(key).map(|v| v.as_f64().ok_or_else(|| bad(key, &v, "expected a number"))).transpose()
    }

    fn bool(&mut self, key: &str) -> Result<Option<bool>, ModelError> {
        self.take(key).map(|v| v.as_bool().ok_or_else(|| bad(key, &v, "expected true or false"))).transpose()
    }

    fn string(&mut self, key: &str) -> Result<Option<String>, ModelError> {
        self.take(key).map(|v| v.as_str().map(String::from).ok_or_else(|| bad(key, &v, "expected a string"))).transpose()
    }

    /// `field` is allowed only with its neutral value (what the forward pass does anyway).
    fn only(&mut self, key: &str, neutral: Value, why: &str) -> Result<(), ModelError> {
        match self.take(key) {
            Some(v) if v != neutral => Err(bad(key, &v, why)),
            _ => Ok(()),
        }
    }
}

impl ModelConfig {
    /// Reads a `config.json` (v4 or v5 layout) completely, refusing what is not implemented.
    pub fn from_json(text: &str) -> Result<Self, ModelError> {
        let cfg = read(text)?;
        cfg.validate()?;
        Ok(cfg)
    }
}

pub fn read(text: &str) -> Result<ModelConfig, ModelError> {
    let map: Map<String, Value> = serde_json::from_str(text).map_err(|e| ModelError::Config(format!("config.json: {e}")))?;
    let mut f = Fields(map);
    let architectures: Vec<String> = match f.take("architectures") {
        Some(v) => serde_json::from_value(v.clone()).map_err(|_| bad("architectures", &v, "expected a list of strings"))?,
        None => vec![],
    };
    if let Some(arch) = architectures.iter().find(|a| !SUPPORTED.contains(&a.as_str())) {
        return Err(ModelError::UnsupportedArchitecture { found: arch.clone(), supported: SUPPORTED.join(", ") });
    }
    let family = match (f.string("model_type")?.as_deref(), architectures.first().map(String::as_str)) {
        (Some("llama"), _) | (None, Some("LlamaForCausalLM") | None) => Family::Llama,
        (Some("mistral"), _) | (None, Some("MistralForCausalLM")) => Family::Mistral,
        (Some("qwen2"), _) | (None, Some("Qwen2ForCausalLM")) => Family::Qwen2,
        (Some(other), _) => return Err(bad("model_type", &Value::from(other), "supported: llama, mistral, qwen2")),
        (None, Some(other)) => return Err(ModelError::UnsupportedArchitecture { found: other.into(), supported: SUPPORTED.join(", ") }),
    };

    let hidden_size = f.required("hidden_size")?;
    let intermediate_size = f.required("intermediate_size")?;
    let num_hidden_layers = f.required("num_hidden_layers")?;
    let num_attention_heads = f.required("num_attention_heads")?;
    let vocab_size = f.required("vocab_size")?;
    let num_key_value_heads = f.usize("num_key_value_heads")?;
    let head_dim = f.usize("head_dim")?;
    let rms_norm_eps = f.f64("rms_norm_eps")?.unwrap_or(1e-6);
    let tie_word_embeddings = f.bool("tie_word_embeddings")?.unwrap_or(false);
    let max_position_embeddings = f.0.get("max_position_embeddings").and_then(Value::as_u64).map(|n| n as usize);
    f.only("hidden_act", Value::from("silu"), "only `silu` (SwiGLU) is implemented")?;

    let (attention_bias, mlp_bias) = match family {
        Family::Llama => (f.bool("attention_bias")?.unwrap_or(false), f.bool("mlp_bias")?.unwrap_or(false)),
        _ => {
            f.only("attention_bias", Value::Bool(false), "only Llama configs may set attention biases")?;
            f.only("mlp_bias", Value::Bool(false), "only Llama configs may set MLP biases")?;
            (false, false)
        }
    };
    let (rope_theta, rope_scaling) = rope(&mut f, max_position_embeddings)?;
    let (sliding_window, layer_types) = sliding(&mut f, family, num_hidden_layers)?;
    f.only("use_mrope", Value::Bool(false), "multimodal RoPE is not implemented")?;

    let bos_token_id = f.0.get("bos_token_id").and_then(Value::as_u64).map(|n| n as u32);
    let eos_token_id = match f.0.get("eos_token_id").filter(|v| !v.is_null()) {
        Some(v) => Some(serde_json::from_value::<TokenIds>(v.clone()).map_err(|_| bad("eos_token_id", v, "expected a token id or a list of them"))?),
        None => None,
    };
    for key in INERT {
        f.0.remove(*key);
    }
    if let Some((key, value)) = f.0.iter().next() {
        return Err(bad(key, value, "not a field kvgate knows; it may change the computation, so the model is refused"));
    }
    Ok(ModelConfig {
        architectures,
        family,
        hidden_size,
        intermediate_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        vocab_size,
        rms_norm_eps,
        rope_theta,
        rope_scaling,
        tie_word_embeddings,
        attention_bias,
        mlp_bias,
        sliding_window,
        layer_types,
        max_position_embeddings,
        bos_token_id,
        eos_token_id,
    })
}

/// RoPE from `rope_parameters` (v5) or `rope_theta` + `rope_scaling` (v4): θ defaults to
/// 10000, the type to `default`, and llama3's original length to `max_position_embeddings`,
/// as `transformers` does.
fn rope(f: &mut Fields, max_positions: Option<usize>) -> Result<(f64, Option<RopeScaling>), ModelError> {
    let top_theta = f.f64("rope_theta")?;
    let (field, params) = match (f.take("rope_parameters"), f.take("rope_scaling")) {
        (Some(p), _) => ("rope_parameters", p),
        (None, Some(p)) => ("rope_scaling", p),
        (None, None) => ("rope_parameters", Value::Object(Map::new())),
    };
    let Value::Object(map) = params else { return Err(bad(field, &params, "expected an object")) };
    let mut p = Fields(map);
    let name = |k: &str| format!("{field}.{k}");
    let theta = p.f64("rope_theta").map_err(|_| ModelError::Config(format!("`{}` must be a number", name("rope_theta"))))?.or(top_theta).unwrap_or(10_000.0);
    let kind = match (p.string("rope_type")?, p.string("type")?) {
        (Some(t), _) | (None, Some(t)) => t,
        (None, None) => "default".into(),
    };
    for partial in [p.take("partial_rotary_factor"), f.take("partial_rotary_factor")].into_iter().flatten() {
        if partial.as_f64() != Some(1.0) {
            return Err(bad(&name("partial_rotary_factor"), &partial, "partial rotary embeddings are not implemented"));
        }
    }
    let scaling = match kind.as_str() {
        "default" => None,
        "linear" => {
            let factor = p.f64("factor")?.ok_or_else(|| ModelError::Config(format!("`{}` is required for linear RoPE", name("factor"))))?;
            Some(RopeScaling { rope_type: kind, factor: Some(factor), ..RopeScaling::default() })
        }
        "llama3" => {
            let mut need = |k: &str| p.f64(k)?.ok_or_else(|| ModelError::Config(format!("`{}` is required for llama3 RoPE", name(k))));
            let (factor, low, high) = (need("factor")?, need("low_freq_factor")?, need("high_freq_factor")?);
            let original = p.usize("original_max_position_embeddings")?.or(max_positions).ok_or_else(|| {
                ModelError::Config(format!("`{}` (or `max_position_embeddings`) is required for llama3 RoPE", name("original_max_position_embeddings")))
            })?;
            Some(RopeScaling {
                rope_type: kind,
                factor: Some(factor),
                low_freq_factor: Some(low),
                high_freq_factor: Some(high),
                original_max_position_embeddings: Some(original),
            })
        }
        other => return Err(bad(&name("rope_type"), &Value::from(other), "implemented: default, linear, llama3")),
    };
    if let Some((key, value)) = p.0.iter().next() {
        return Err(bad(&name(key), value, "not a RoPE parameter of this rope_type"));
    }
    Ok((theta, scaling))
}

/// Mistral: `sliding_window` on every layer (4096 when absent, `null` for none). Qwen2: only
/// with `use_sliding_window`, on the layers `layer_types` names (derived from
/// `max_window_layers` when absent). Llama has none.
fn sliding(f: &mut Fields, family: Family, layers: usize) -> Result<(Option<usize>, Option<Vec<String>>), ModelError> {
    let present = f.0.contains_key("sliding_window");
    let window = f.usize("sliding_window")?;
    if window == Some(0) {
        return Err(bad("sliding_window", &Value::from(0), "must be at least 1"));
    }
    match family {
        Family::Llama => {
            if let Some(w) = window {
                return Err(bad("sliding_window", &Value::from(w), "Llama models have no sliding window"));
            }
            Ok((None, None))
        }
        Family::Mistral => Ok((if present { window } else { Some(4096) }, None)),
        Family::Qwen2 => {
            let used = f.bool("use_sliding_window")?.unwrap_or(false);
            let max_window_layers = f.usize("max_window_layers")?.unwrap_or(28);
            let window = window.filter(|_| used);
            let types: Vec<String> = match f.take("layer_types") {
                Some(v) => serde_json::from_value(v.clone()).map_err(|_| bad("layer_types", &v, "expected a list of strings"))?,
                None => {
                    (0..layers).map(|i| if window.is_some() && i >= max_window_layers { "sliding_attention" } else { "full_attention" }.to_string()).collect()
                }
            };
            if types.len() != layers {
                return Err(ModelError::Config(format!("`layer_types` has {} entries for {layers} layers", types.len())));
            }
            if let Some(t) = types.iter().find(|t| *t != "full_attention" && *t != "sliding_attention") {
                return Err(bad("layer_types", &Value::from(t.as_str()), "implemented: full_attention, sliding_attention"));
            }
            Ok((window, Some(types)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: &str = r#""hidden_size":32,"intermediate_size":64,"num_hidden_layers":3,"num_attention_heads":4,"vocab_size":128"#;

    fn config(extra: &str) -> Result<ModelConfig, ModelError> {
        read(&format!("{{{SHAPE},{extra}}}"))
    }

    #[test]
    fn both_layouts_give_the_same_rope() {
        let v5 = config(r#""model_type":"llama","max_position_embeddings":4096,"rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0}"#).unwrap();
        let v4 = config(r#""model_type":"llama","max_position_embeddings":4096,"rope_theta":500000.0,"rope_scaling":{"type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0}"#).unwrap();
        assert_eq!((v5.rope_theta, &v5.rope_scaling), (v4.rope_theta, &v4.rope_scaling));
        // As transformers does: llama3's original length defaults to max_position_embeddings.
        assert_eq!(v5.rope_scaling.unwrap().original_max_position_embeddings, Some(4096));
        assert_eq!(config(r#""model_type":"llama""#).unwrap().rope_theta, 10_000.0);
    }

    #[test]
    fn sliding_windows_follow_each_family() {
        let mistral = config(r#""model_type":"mistral""#).unwrap();
        assert_eq!(mistral.window(0), Some(4096), "Mistral's default window");
        assert_eq!(config(r#""model_type":"mistral","sliding_window":null"#).unwrap().window(0), None);
        let qwen = config(r#""model_type":"qwen2","use_sliding_window":true,"sliding_window":8,"max_window_layers":1"#).unwrap();
        assert_eq!((qwen.window(0), qwen.window(1), qwen.window(2)), (None, Some(8), Some(8)));
        let off = config(r#""model_type":"qwen2","use_sliding_window":false,"sliding_window":8"#).unwrap();
        assert_eq!(off.window(2), None);
        let err = config(r#""model_type":"llama","sliding_window":8"#).unwrap_err().to_string();
        assert!(err.contains("sliding_window"), "{err}");
    }

    #[test]
    fn refusals_name_the_field_and_value() {
        for (extra, field) in [
            (r#""model_type":"mistral","attention_bias":true"#, "attention_bias"),
            (r#""rope_parameters":{"rope_type":"dynamic","factor":2.0}"#, "rope_parameters.rope_type"),
            (r#""rope_parameters":{"rope_type":"linear","factor":2.0,"beta_fast":32}"#, "rope_parameters.beta_fast"),
            (r#""quantization_config":{"quant_method":"gptq"}"#, "quantization_config"),
            (r#""model_type":"qwen2","layer_types":["full_attention"]"#, "layer_types"),
        ] {
            let err = config(extra).unwrap_err().to_string();
            assert!(err.contains(field), "{extra}: {err}");
        }
    }
}
