//! The model: config, weights (built-in tiny, a safetensors checkpoint or a GGUF file),
//! forward pass and sampling.

pub mod checkpoint;
#[cfg(test)]
mod checkpoint_tests;
mod chunk_attention;
pub mod config;
mod config_reader;
pub mod gguf;
#[cfg(test)]
mod gguf_tests;
mod host_slice;
pub mod layer;
pub mod llama;
pub mod logprobs;
mod projection;
mod reference;
pub mod rope;
pub mod sampling;
#[cfg(test)]
mod tests;
pub mod tiny;
mod token_attention;
pub mod weights;

use std::path::{Path, PathBuf};

use candle_core::Device;
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

pub use config::ModelConfig;
pub use llama::{Llama, SeqStep};
pub use sampling::{Sampler, SamplingParams};

use crate::kv::{KvDtype, KvLayout};
use crate::tokenizer::Tokenizer;
use weights::Weights;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error("model file not found: {0}")]
    MissingFile(PathBuf),
    #[error("reading {0}: {1}")]
    Io(PathBuf, std::io::Error),
    #[error("bad model config: {0}")]
    Config(String),
    #[error("unsupported architecture `{found}` (supported: {supported})")]
    UnsupportedArchitecture { found: String, supported: String },
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error("loading weights: {0}")]
    Weights(#[from] candle_core::Error),
}

/// Where to get the model from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    Tiny,
    Dir(PathBuf),
    /// A `.gguf` file.
    Gguf(PathBuf),
}

impl std::str::FromStr for ModelSource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "tiny" => ModelSource::Tiny,
            _ if s.ends_with(".gguf") => ModelSource::Gguf(PathBuf::from(s)),
            _ => ModelSource::Dir(PathBuf::from(s)),
        })
    }
}

impl ModelSource {
    /// The model's name: `tiny`, or the directory's or file's name.
    pub fn name(&self) -> String {
        let of = |p: &Path| p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned());
        match self {
            ModelSource::Tiny => "tiny".into(),
            ModelSource::Dir(p) | ModelSource::Gguf(p) => of(p),
        }
    }
}

/// A loaded model with everything serving needs to know about it.
#[derive(Debug)]
pub struct Model {
    pub name: String,
    pub llama: Llama,
    pub tokenizer: std::sync::Arc<Tokenizer>,
    pub fingerprint: String,
    pub eos: Vec<u32>,
}

impl Model {
    pub fn load(source: &ModelSource, device: &Device) -> Result<Self, ModelError> {
        match source {
            ModelSource::Tiny => Self::tiny(device),
            ModelSource::Dir(dir) => Self::from_dir(dir, device),
            ModelSource::Gguf(file) => Self::from_gguf(file, device),
        }
    }

    pub fn tiny(device: &Device) -> Result<Self, ModelError> {
        let cfg = tiny::config();
        let llama = Llama::load(&cfg, &Weights::Safetensors { vb: tiny::var_builder(device)?, stored: Default::default() })?;
        let text = serde_json::to_string(&cfg).map_err(|e| ModelError::Config(e.to_string()))?;
        let fingerprint = format!("{:016x}", xxh3_64(format!("tiny-r{}:{text}", tiny::TINY_REVISION).as_bytes()));
        Ok(Model { name: "tiny".into(), eos: cfg.eos_ids(), llama, tokenizer: std::sync::Arc::new(Tokenizer::Bytes), fingerprint })
    }

    pub fn from_dir(dir: &Path, device: &Device) -> Result<Self, ModelError> {
        let ckpt = checkpoint::Checkpoint::open(dir)?;
        let tokenizer = std::sync::Arc::new(Tokenizer::from_file(&ckpt.tokenizer)?);
        let (vb, stored) = ckpt.weights(device)?;
        let llama = Llama::load(&ckpt.config, &Weights::Safetensors { vb, stored })?;
        let name = ModelSource::Dir(dir.to_path_buf()).name();
        Ok(Model { name, eos: ckpt.config.eos_ids(), fingerprint: ckpt.fingerprint()?, llama, tokenizer })
    }

    /// A GGUF file, on the CPU: its quantized weights stay quantized.
    pub fn from_gguf(file: &Path, device: &Device) -> Result<Self, ModelError> {
        if !matches!(device, Device::Cpu) {
            return Err(ModelError::Config(format!("{}: GGUF files are served on the CPU only", file.display())));
        }
        if !file.is_file() {
            return Err(ModelError::MissingFile(file.to_path_buf()));
        }
        let gguf = gguf::Gguf::open(file)?;
        let tokenizer = std::sync::Arc::new(gguf.tokenizer()?);
        let llama = Llama::load(&gguf.config, &Weights::Gguf(&gguf))?;
        let name = ModelSource::Gguf(file.to_path_buf()).name();
        Ok(Model { name, eos: gguf.config.eos_ids(), fingerprint: gguf.fingerprint()?, llama, tokenizer })
    }

    /// Token ids this model embeds: `0..vocab_size()`.
    pub fn vocab_size(&self) -> usize {
        self.llama.config().vocab_size
    }

    /// The KV layout this model needs with the given page size and dtype.
    pub fn kv_layout(&self, page_size: usize, dtype: KvDtype) -> KvLayout {
        let c = self.llama.config();
        KvLayout { num_layers: c.num_hidden_layers, num_kv_heads: c.num_kv_heads(), head_dim: c.head_dim(), page_size, dtype }
    }
}
