//! Loading a GGUF file, llama.cpp's format: the hyper-parameters and the tokenizer from its
//! metadata (no `config.json`), the tensors as stored (quantized blocks stay quantized). A
//! metadata key of the architecture that this worker does not implement is refused naming it,
//! as `config.json`'s fields are, and so is a tensor it would not use.
//!
//! llama.cpp's converter permutes the rows of Llama's Q and K so that its RoPE can rotate
//! adjacent pairs; the loader puts them back in the checkpoint's order (whole rows move, so a
//! quantized row stays as it is), and the model rotates halves as it does for every checkpoint.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::Device;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{QStorage, QTensor};

use super::ModelError;
use super::checkpoint::fingerprint_of;
use super::config::{Family, ModelConfig, RopeScaling, TokenIds};

/// Keys of `{arch}.` this loader reads; any other key of the architecture is refused.
const READ: &[&str] = &[
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "vocab_size",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.dimension_count",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
];

/// The GGUF architectures whose tensors follow the layout this worker implements (Mistral's
/// files say `llama`).
pub const ARCHITECTURES: &[&str] = &["llama", "qwen2"];

pub struct Gguf {
    path: PathBuf,
    /// The file, read tensor by tensor as the model asks for them.
    reader: Mutex<BufReader<File>>,
    content: Content,
    pub config: ModelConfig,
    /// `general.architecture`.
    pub arch: String,
}

fn bad(key: &str, why: impl std::fmt::Display) -> ModelError {
    ModelError::Config(format!("GGUF metadata `{key}`: {why}"))
}

impl Gguf {
    /// Reads the header, metadata and tensor index (not the tensors) and checks every key.
    pub fn open(path: &Path) -> Result<Gguf, ModelError> {
        let mut f = BufReader::new(File::open(path).map_err(|e| ModelError::Io(path.to_path_buf(), e))?);
        let content = Content::read(&mut f).map_err(|e| ModelError::Config(format!("{}: not a GGUF file: {e}", path.display())))?;
        let arch = string(&content.metadata, "general.architecture")?;
        if !ARCHITECTURES.contains(&arch.as_str()) {
            return Err(ModelError::UnsupportedArchitecture { found: format!("GGUF `{arch}`"), supported: ARCHITECTURES.join(", ") });
        }
        let config = config(&content, &arch)?;
        config.validate()?;
        let gguf = Gguf { path: path.to_path_buf(), reader: Mutex::new(f), content, config, arch };
        gguf.check_tensors()?;
        Ok(gguf)
    }

    /// Every tensor the file holds is one the model uses.
    fn check_tensors(&self) -> Result<(), ModelError> {
        let layers = self.config.num_hidden_layers;
        let mut known: Vec<String> = ["token_embd.weight", "output_norm.weight", "output.weight"].map(String::from).to_vec();
        for i in 0..layers {
            for t in ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"] {
                known.push(format!("blk.{i}.{t}.weight"));
            }
            for t in ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"] {
                known.push(format!("blk.{i}.{t}.bias"));
            }
        }
        let mut extra: Vec<&String> = self.content.tensor_infos.keys().filter(|n| !known.contains(n)).collect();
        extra.sort();
        if let Some(name) = extra.first() {
            let why = match name.as_str() {
                "rope_freqs.weight" => "per-dimension RoPE factors (Llama 3.1's long-context scaling) are not implemented",
                _ => "this worker does not implement what it is for",
            };
            return Err(ModelError::Config(format!("GGUF tensor `{name}`: {why}")));
        }
        Ok(())
    }

    /// A tensor as stored; Llama's Q and K (weights and biases) in the checkpoint's row order.
    pub fn tensor(&self, name: &str) -> Result<QTensor, ModelError> {
        let mut f = self.reader.lock().unwrap_or_else(|p| p.into_inner());
        let t = self.content.tensor(&mut *f, name, &Device::Cpu).map_err(|e| ModelError::Config(format!("GGUF tensor `{name}`: {e}")))?;
        let heads = if name.ends_with("attn_q.weight") || name.ends_with("attn_q.bias") {
            Some(self.config.num_attention_heads)
        } else if name.ends_with("attn_k.weight") || name.ends_with("attn_k.bias") {
            Some(self.config.num_kv_heads())
        } else {
            None
        };
        match heads {
            // GGUF's llama converter permutes Q and K for its RoPE; qwen2's does not.
            Some(heads) if self.config.family == Family::Llama => unpermute(&t, heads).map_err(ModelError::from),
            _ => Ok(t),
        }
    }

    /// The tokenizer the metadata describes.
    pub fn tokenizer(&self) -> Result<crate::tokenizer::Tokenizer, ModelError> {
        Ok(crate::tokenizer::Tokenizer::from_gguf(&self.content)?)
    }

    /// Hash of every byte of the file: two workers agree only on identical models.
    pub fn fingerprint(&self) -> Result<String, ModelError> {
        fingerprint_of(b"", std::slice::from_ref(&self.path))
    }
}

/// llama.cpp's converter stores row `h*d + 2i + j` of a head's Q or K where the checkpoint has
/// row `h*d + j*d/2 + i`; this moves every row back.
fn unpermute(t: &QTensor, heads: usize) -> candle_core::Result<QTensor> {
    let dims = t.shape().dims().to_vec();
    let rows = dims[0];
    let data = t.data()?;
    let row_bytes = data.len() / rows;
    let d = rows / heads;
    let mut out = vec![0u8; data.len()];
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..d / 2 {
                let (to, from) = (h * d + j * d / 2 + i, h * d + 2 * i + j);
                out[to * row_bytes..][..row_bytes].copy_from_slice(&data[from * row_bytes..][..row_bytes]);
            }
        }
    }
    QTensor::new(QStorage::from_data(Cow::Owned(out), &Device::Cpu, t.dtype())?, dims)
}

fn get<'a>(m: &'a HashMap<String, Value>, key: &str) -> Result<&'a Value, ModelError> {
    m.get(key).ok_or_else(|| ModelError::Config(format!("GGUF metadata: missing `{key}`")))
}

fn string(m: &HashMap<String, Value>, key: &str) -> Result<String, ModelError> {
    get(m, key)?.to_string().cloned().map_err(|e| bad(key, e))
}

fn uint(v: &Value, key: &str) -> Result<usize, ModelError> {
    match v {
        Value::U8(n) => Ok(*n as usize),
        Value::U16(n) => Ok(*n as usize),
        Value::U32(n) => Ok(*n as usize),
        Value::U64(n) => Ok(*n as usize),
        Value::I32(n) if *n >= 0 => Ok(*n as usize),
        Value::I64(n) if *n >= 0 => Ok(*n as usize),
        Value::Array(_) => Err(bad(key, "a value per layer is not implemented")),
        other => Err(bad(key, format!("expected a non-negative integer, got {other:?}"))),
    }
}

fn float(v: &Value, key: &str) -> Result<f64, ModelError> {
    match v {
        Value::F32(x) => Ok(f64::from(*x)),
        Value::F64(x) => Ok(*x),
        other => uint(other, key).map(|n| n as f64),
    }
}

/// The configuration the metadata of `arch` describes.
fn config(content: &Content, arch: &str) -> Result<ModelConfig, ModelError> {
    let m = &content.metadata;
    let prefix = format!("{arch}.");
    let mut unknown: Vec<&String> = m.keys().filter(|k| k.strip_prefix(&prefix).is_some_and(|rest| !READ.contains(&rest))).collect();
    unknown.sort();
    if let Some(key) = unknown.first() {
        return Err(bad(key, "this worker does not implement it"));
    }
    let key = |k: &str| format!("{prefix}{k}");
    let req = |k: &str| get(m, &key(k)).and_then(|v| uint(v, &key(k)));
    let opt = |k: &str| m.get(&key(k)).map(|v| uint(v, &key(k))).transpose();
    let hidden = req("embedding_length")?;
    let heads = req("attention.head_count")?;
    let head_dim = opt("attention.key_length")?.unwrap_or(hidden / heads.max(1));
    for k in ["attention.value_length", "rope.dimension_count"] {
        if let Some(n) = opt(k)?.filter(|n| *n != head_dim) {
            return Err(bad(&key(k), format!("{n} differs from the head size {head_dim}, which this worker does not implement")));
        }
    }
    let rope_scaling = match m.get(&key("rope.scaling.type")).map(|v| v.to_string().map(String::as_str)) {
        None | Some(Ok("none")) => None,
        Some(Ok("linear")) => {
            let factor = m.get(&key("rope.scaling.factor")).map(|v| float(v, &key("rope.scaling.factor"))).transpose()?;
            Some(RopeScaling { rope_type: "linear".into(), factor, ..Default::default() })
        }
        Some(Ok(other)) => return Err(bad(&key("rope.scaling.type"), format!("`{other}` is not implemented (none, linear)"))),
        Some(Err(e)) => return Err(bad(&key("rope.scaling.type"), e)),
    };
    let tokens = get(m, "tokenizer.ggml.tokens")?.to_vec().map_err(|e| bad("tokenizer.ggml.tokens", e))?.len();
    let vocab = opt("vocab_size")?.unwrap_or(tokens);
    let token = |k: &str| m.get(k).map(|v| uint(v, k).map(|n| n as u32)).transpose();
    let has = |name: &str| content.tensor_infos.contains_key(name);
    // Mistral's files say `llama` too: one family here, with Llama's defaults from the metadata.
    let family = if arch == "qwen2" { Family::Qwen2 } else { Family::Llama };
    Ok(ModelConfig {
        architectures: vec![if family == Family::Qwen2 { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" }.into()],
        family,
        hidden_size: hidden,
        intermediate_size: req("feed_forward_length")?,
        num_hidden_layers: req("block_count")?,
        num_attention_heads: heads,
        num_key_value_heads: Some(opt("attention.head_count_kv")?.unwrap_or(heads)),
        head_dim: Some(head_dim),
        vocab_size: vocab,
        rms_norm_eps: get(m, &key("attention.layer_norm_rms_epsilon")).and_then(|v| float(v, &key("attention.layer_norm_rms_epsilon")))?,
        rope_theta: m.get(&key("rope.freq_base")).map(|v| float(v, &key("rope.freq_base"))).transpose()?.unwrap_or(10_000.0),
        rope_scaling,
        tie_word_embeddings: !has("output.weight"),
        attention_bias: family != Family::Qwen2 && has("blk.0.attn_q.bias"),
        mlp_bias: has("blk.0.ffn_up.bias"),
        sliding_window: None,
        layer_types: None,
        max_position_embeddings: opt("context_length")?,
        bos_token_id: token("tokenizer.ggml.bos_token_id")?,
        eos_token_id: token("tokenizer.ggml.eos_token_id")?.map(TokenIds::One),
    })
}
