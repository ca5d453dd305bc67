//! Loading a real checkpoint from a directory: `config.json`, `model.safetensors` or shards
//! listed in `model.safetensors.index.json`, and `tokenizer.json`.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use xxhash_rust::xxh3::Xxh3;

use super::ModelError;
use super::config::ModelConfig;

pub struct Checkpoint {
    pub config: ModelConfig,
    pub config_text: String,
    pub weights: Vec<PathBuf>,
    pub tokenizer: PathBuf,
}

impl Checkpoint {
    /// Finds and checks every file the model needs, before anything large is read.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        if !dir.is_dir() {
            return Err(ModelError::MissingFile(dir.to_path_buf()));
        }
        let config_path = require(dir.join("config.json"))?;
        let config_text = std::fs::read_to_string(&config_path).map_err(|e| ModelError::Io(config_path.clone(), e))?;
        let config = ModelConfig::from_json(&config_text)?;
        let tokenizer = require(dir.join("tokenizer.json"))?;
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let weights = if single.is_file() {
            vec![single]
        } else if index.is_file() {
            shards(dir, &index)?
        } else {
            return Err(ModelError::MissingFile(single));
        };
        Ok(Checkpoint { config, config_text, weights, tokenizer })
    }

    /// Memory-maps the weights once: a builder that reads each tensor widened to f32, and each
    /// tensor's type as the files store it, by name (from the headers).
    pub fn weights(&self, device: &Device) -> Result<(VarBuilder<'static>, HashMap<String, DType>), ModelError> {
        // SAFETY: the files are opened read-only; like every safetensors loader we rely on them
        // not being modified while the worker runs.
        let st = unsafe { MmapedSafetensors::multi(&self.weights) }?;
        let stored = st.tensors().into_iter().map(|(name, view)| Ok((name, DType::try_from(view.dtype())?))).collect::<Result<_, ModelError>>()?;
        Ok((VarBuilder::from_backend(Box::new(st), DType::F32, device.clone()), stored))
    }

    /// Hash of the config and every weight byte: two workers agree only on identical models.
    pub fn fingerprint(&self) -> Result<String, ModelError> {
        fingerprint_of(self.config_text.as_bytes(), &self.weights)
    }
}

/// xxh3 of `head` and then every byte of `files`, as hex.
pub(super) fn fingerprint_of(head: &[u8], files: &[PathBuf]) -> Result<String, ModelError> {
    let mut h = Xxh3::new();
    h.update(head);
    let mut buf = vec![0u8; 1 << 20];
    for path in files {
        let mut f = File::open(path).map_err(|e| ModelError::Io(path.clone(), e))?;
        loop {
            let n = f.read(&mut buf).map_err(|e| ModelError::Io(path.clone(), e))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(format!("{:016x}", h.digest()))
}

fn require(path: PathBuf) -> Result<PathBuf, ModelError> {
    if path.is_file() { Ok(path) } else { Err(ModelError::MissingFile(path)) }
}

/// The distinct shard files named by the index's `weight_map`, each required to exist.
fn shards(dir: &Path, index: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let text = std::fs::read_to_string(index).map_err(|e| ModelError::Io(index.to_path_buf(), e))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Config(format!("{}: {e}", index.display())))?;
    let map = value.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| ModelError::Config(format!("{}: no `weight_map` object", index.display())))?;
    let files: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
    files.into_iter().map(|f| require(dir.join(f))).collect()
}
