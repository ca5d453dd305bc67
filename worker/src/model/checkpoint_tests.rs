//! Loading real checkpoint directories: the tiny model written out as safetensors (whole and
//! sharded) with a `tokenizer.json`, and every way a directory can be wrong.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};

use super::{Model, ModelError, tiny};
use crate::test_data::TempDir;

const TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
  "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
  "model":{"type":"WordLevel","vocab":{"[UNK]":0,"hello":1,"paged":2,"world":3},"unk_token":"[UNK]"}}"#;

fn dir(name: &str) -> TempDir {
    TempDir::new(&format!("ckpt-{name}"))
}

fn write_checkpoint(d: &Path, tensors: &HashMap<String, Tensor>) {
    std::fs::write(d.join("config.json"), serde_json::to_string(&tiny::config()).unwrap()).unwrap();
    std::fs::write(d.join("tokenizer.json"), TOKENIZER).unwrap();
    candle_core::safetensors::save(tensors, d.join("model.safetensors")).unwrap();
}

fn logits(m: &Model, tokens: &[u32]) -> Vec<f32> {
    m.llama.forward_reference(tokens).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn a_checkpoint_directory_loads_the_same_model() {
    let d = dir("whole");
    write_checkpoint(&d, &tiny::tensors(&Device::Cpu).unwrap());
    let m = Model::from_dir(&d, &Device::Cpu).unwrap();
    let t = Model::tiny(&Device::Cpu).unwrap();
    assert_eq!(logits(&m, &[1, 2, 3]), logits(&t, &[1, 2, 3]));
    assert_eq!(m.tokenizer.encode("hello paged world").unwrap(), vec![1, 2, 3]);
    assert_eq!(m.fingerprint.len(), 16);
    assert_ne!(m.fingerprint, t.fingerprint, "a checkpoint's fingerprint covers its bytes");
}

#[test]
fn sharded_weights_load_through_the_index() {
    let d = dir("sharded");
    let all = tiny::tensors(&Device::Cpu).unwrap();
    let (mut a, mut b) = (HashMap::new(), HashMap::new());
    let mut map = serde_json::Map::new();
    for (i, (name, t)) in all.into_iter().enumerate() {
        let file = if i % 2 == 0 { "model-00001-of-00002.safetensors" } else { "model-00002-of-00002.safetensors" };
        map.insert(name.clone(), file.into());
        if i % 2 == 0 {
            a.insert(name, t)
        } else {
            b.insert(name, t)
        };
    }
    std::fs::write(d.join("config.json"), serde_json::to_string(&tiny::config()).unwrap()).unwrap();
    std::fs::write(d.join("tokenizer.json"), TOKENIZER).unwrap();
    candle_core::safetensors::save(&a, d.join("model-00001-of-00002.safetensors")).unwrap();
    candle_core::safetensors::save(&b, d.join("model-00002-of-00002.safetensors")).unwrap();
    std::fs::write(d.join("model.safetensors.index.json"), serde_json::json!({ "weight_map": map }).to_string()).unwrap();
    let m = Model::from_dir(&d, &Device::Cpu).unwrap();
    assert_eq!(logits(&m, &[5, 6]), logits(&Model::tiny(&Device::Cpu).unwrap(), &[5, 6]));
}

#[test]
fn a_missing_file_is_named() {
    let d = dir("missing");
    write_checkpoint(&d, &tiny::tensors(&Device::Cpu).unwrap());
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    let err = Model::from_dir(&d, &Device::Cpu).unwrap_err();
    assert!(matches!(err, ModelError::MissingFile(_)) && err.to_string().contains("tokenizer.json"), "{err}");
}

#[test]
fn a_shape_mismatch_names_the_tensor() {
    let d = dir("shape");
    let mut t = tiny::tensors(&Device::Cpu).unwrap();
    t.insert("model.layers.1.self_attn.k_proj.weight".into(), Tensor::zeros((7, 64), candle_core::DType::F32, &Device::Cpu).unwrap());
    write_checkpoint(&d, &t);
    let err = Model::from_dir(&d, &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("model.layers.1.self_attn.k_proj.weight"), "{err}");
}

#[test]
fn an_unsupported_architecture_is_refused_before_loading_weights() {
    let d = dir("arch");
    write_checkpoint(&d, &tiny::tensors(&Device::Cpu).unwrap());
    let mut cfg = tiny::config();
    cfg.architectures = vec!["MambaForCausalLM".into()];
    std::fs::write(d.join("config.json"), serde_json::to_string(&cfg).unwrap()).unwrap();
    let err = Model::from_dir(&d, &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("MambaForCausalLM") && err.contains("supported"), "{err}");
}

/// A checkpoint stored in f16 or bf16 is kept so (projections, output layer and embedding table:
/// half the memory of f32), and computes bit for bit what its weights widened to f32 give.
#[test]
fn a_half_checkpoint_stays_half_and_computes_its_widened_weights() {
    use candle_core::DType;
    for dtype in [DType::F16, DType::BF16] {
        let narrowed: HashMap<String, Tensor> = tiny::tensors(&Device::Cpu).unwrap().into_iter().map(|(n, t)| (n, t.to_dtype(dtype).unwrap())).collect();
        let widened: HashMap<String, Tensor> = narrowed.iter().map(|(n, t)| (n.clone(), t.to_dtype(DType::F32).unwrap())).collect();
        let (h, w) = (dir(&format!("{dtype:?}")), dir(&format!("{dtype:?}-widened")));
        write_checkpoint(&h, &narrowed);
        write_checkpoint(&w, &widened);
        let (half, wide) = (Model::from_dir(&h, &Device::Cpu).unwrap(), Model::from_dir(&w, &Device::Cpu).unwrap());
        assert!(half.llama.layers_half(), "{dtype:?}: {}", half.llama.weight_types());
        assert!(matches!(half.llama.embed, super::layer::Embed::Half(_)), "{dtype:?}: the embedding table was widened");
        assert!(!wide.llama.layers_half(), "an f32 checkpoint is computed in f32: {}", wide.llama.weight_types());
        let bits = |m: &Model| logits(m, &[1, 2, 3, 200, 7]).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&half), bits(&wide), "{dtype:?}");
    }
}
