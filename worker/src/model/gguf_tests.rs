//! GGUF loading: the tiny model written as llama.cpp's converter writes a Llama (its names, Q and
//! K rows permuted, a SentencePiece vocabulary of the same bytes) loads back to the same model,
//! in f32 exactly and in Q8_0 within quantization's error; what the loader does not implement
//! is refused naming the key or tensor.

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use super::llama::to_vec;
use super::weights::gguf_name;
use super::{Model, ModelError, tiny};
use crate::test_data::TempDir;

/// llama.cpp's row order for a head's Q or K (`convert_hf_to_gguf.py`'s `permute`).
fn permute(w: &Tensor, heads: usize) -> Tensor {
    let (rows, cols) = w.dims2().unwrap();
    let d = rows / heads;
    w.reshape((heads, 2, d / 2, cols)).unwrap().transpose(1, 2).unwrap().contiguous().unwrap().reshape((rows, cols)).unwrap()
}

/// The tiny model as a GGUF file, each 2-D weight in the type `kind` picks for its name, with
/// `extra` metadata and tensors.
fn write_tiny(path: &Path, kind: impl Fn(&str) -> GgmlDType, extra: &[(&str, Value)], extra_tensors: &[&str]) {
    let cfg = tiny::config();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for (name, t) in tiny::tensors(&Device::Cpu).unwrap() {
        let base = name.strip_suffix(".weight").unwrap();
        let t = if base.ends_with("q_proj") {
            permute(&t, cfg.num_attention_heads)
        } else if base.ends_with("k_proj") {
            permute(&t, cfg.num_kv_heads())
        } else {
            t
        };
        let g = format!("{}.weight", gguf_name(base));
        let dtype = if t.rank() == 2 { kind(&g) } else { GgmlDType::F32 };
        tensors.push((g, QTensor::quantize(&t, dtype).unwrap()));
    }
    for name in extra_tensors {
        tensors.push((name.to_string(), QTensor::quantize(&Tensor::ones(8, candle_core::DType::F32, &Device::Cpu).unwrap(), GgmlDType::F32).unwrap()));
    }
    // The byte tokenizer's vocabulary as SentencePiece pieces: ids 0-255 the bytes, then BOS and
    // EOS; no space in front, so a text's ids are its bytes, as `Tokenizer::Bytes` gives them.
    let mut pieces: Vec<Value> = (0..=255u8).map(|b| Value::String(format!("<0x{b:02X}>"))).collect();
    pieces.extend([Value::String("<s>".into()), Value::String("</s>".into())]);
    let mut types: Vec<Value> = vec![Value::I32(6); 256];
    types.extend([Value::I32(3), Value::I32(3)]);
    let u = |n: usize| Value::U32(n as u32);
    let mut meta: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.context_length", u(8192)),
        ("llama.embedding_length", u(cfg.hidden_size)),
        ("llama.block_count", u(cfg.num_hidden_layers)),
        ("llama.feed_forward_length", u(cfg.intermediate_size)),
        ("llama.attention.head_count", u(cfg.num_attention_heads)),
        ("llama.attention.head_count_kv", u(cfg.num_kv_heads())),
        ("llama.rope.dimension_count", u(cfg.head_dim())),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(cfg.rms_norm_eps as f32)),
        ("llama.rope.freq_base", Value::F32(cfg.rope_theta as f32)),
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", Value::Array(pieces)),
        ("tokenizer.ggml.scores", Value::Array(vec![Value::F32(0.0); 258])),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.bos_token_id", u(256)),
        ("tokenizer.ggml.eos_token_id", u(257)),
        ("tokenizer.ggml.add_space_prefix", Value::Bool(false)),
    ];
    meta.extend(extra.iter().map(|(k, v)| (*k, v.clone())));
    let meta: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &meta, &tensors).unwrap();
}

/// `model.gguf` in a directory of its own, removed when the returned guard drops.
fn scratch(name: &str) -> (TempDir, PathBuf) {
    let dir = TempDir::new(&format!("gguf-{name}"));
    let file = dir.join("model.gguf");
    (dir, file)
}

const PROMPT: &str = "GGUF holds the same model; the rows of Q and K are only in another order.";

/// Logits of every position of `PROMPT` (the tiny model's ids) by the contiguous reference path.
fn logits(m: &Model) -> Vec<Vec<f32>> {
    let tokens = Model::tiny(&Device::Cpu).unwrap().tokenizer.encode(PROMPT).unwrap();
    let all = m.llama.forward_reference(&tokens).unwrap();
    (0..tokens.len()).map(|i| to_vec(&all.get(i).unwrap()).unwrap()).collect()
}

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0
}

#[test]
fn the_tiny_model_written_as_llamacpp_writes_it_loads_back_the_same() {
    let tiny = Model::tiny(&Device::Cpu).unwrap();
    let want = logits(&tiny);

    let (_dir, f32_file) = scratch("f32");
    write_tiny(&f32_file, |_| GgmlDType::F32, &[], &[]);
    let m = Model::from_gguf(&f32_file, &Device::Cpu).unwrap();
    // Without a `▁` piece a space is spelled in its three bytes, as llama.cpp spells it; a text
    // without spaces is its bytes, as the tiny model's tokenizer gives them.
    let text = "GGUF,holds;the-same.model";
    assert_eq!(m.tokenizer.encode(text).unwrap(), tiny.tokenizer.encode(text).unwrap(), "the same ids");
    assert_eq!(m.tokenizer.decode(&m.tokenizer.encode(text).unwrap()).unwrap(), text);
    assert_eq!(m.tokenizer.encode(" ").unwrap(), [256, 0xE2, 0x96, 0x81]);
    assert_eq!((m.eos.clone(), m.llama.config().num_kv_heads(), m.llama.config().head_dim()), (tiny.eos.clone(), 2, 16));
    let got = logits(&m);
    let d = got.iter().zip(&want).flat_map(|(g, w)| g.iter().zip(w).map(|(a, b)| (a - b).abs())).fold(0.0f32, f32::max);
    assert!(d < 1e-4, "f32 GGUF vs the tiny model: logits differ by {d}");

    // Q8_0 where a row is whole blocks of 32 (the down projection's 176 inputs are not: f32, as
    // llama.cpp's quantizer leaves such a tensor), so the stacked layers mix nothing but the
    // output layers do.
    let (_dir, q8_file) = scratch("q8");
    write_tiny(&q8_file, |name| if name.contains("ffn_down") { GgmlDType::F32 } else { GgmlDType::Q8_0 }, &[], &[]);
    let m = Model::from_gguf(&q8_file, &Device::Cpu).unwrap();
    assert_eq!(m.llama.weight_types(), "qkv q8_0, o q8_0, gate/up q8_0, down f32, output q8_0");
    let got = logits(&m);
    let (mut same, mut worst) = (0, 0.0f32);
    for (g, w) in got.iter().zip(&want) {
        same += usize::from(argmax(g) == argmax(w));
        let scale = w.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        worst = worst.max(g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max) / scale);
    }
    println!("Q8_0 GGUF vs f32: largest logit difference {worst:.4} of the largest logit; greedy token the same at {same} of {} positions", got.len());
    assert!(worst < 0.05, "Q8_0 logits differ from f32 by {worst} of the largest logit");
    assert!(same * 10 >= got.len() * 9, "Q8_0 agrees with f32 on the greedy token at {same} of {} positions", got.len());
    assert_ne!(super::gguf::Gguf::open(&q8_file).unwrap().fingerprint().unwrap(), super::gguf::Gguf::open(&f32_file).unwrap().fingerprint().unwrap());
}

/// The largest logit difference against `want`, relative to the largest logit, and at how many
/// positions the greedy token is the same.
fn compare(got: &[Vec<f32>], want: &[Vec<f32>]) -> (f32, usize) {
    let (mut worst, mut same) = (0.0f32, 0);
    for (g, w) in got.iter().zip(want) {
        same += usize::from(argmax(g) == argmax(w));
        let scale = w.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        worst = worst.max(g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max) / scale);
    }
    (worst, same)
}

/// f16 and bf16 GGUF weights (as llama.cpp's converter writes most downloads) stay half in
/// memory and compute close to the f32 model; the serving path (`projection::project`) gives the
/// bits of the reference path, which widens them.
#[test]
fn half_precision_weights_stay_half_and_compute_close_to_f32() {
    let want = logits(&Model::tiny(&Device::Cpu).unwrap());
    // Per type: the bound on the largest logit difference, relative to the largest logit (f16
    // keeps 11 bits of each weight, bf16 8).
    for (dtype, name, bound) in [(GgmlDType::F16, "f16", 0.01f32), (GgmlDType::BF16, "bf16", 0.05)] {
        let (_dir, file) = scratch(name);
        write_tiny(&file, |_| dtype, &[], &[]);
        let m = Model::from_gguf(&file, &Device::Cpu).unwrap();
        assert_eq!(m.llama.weight_types(), format!("qkv {name}, o {name}, gate/up {name}, down {name}, output {name}"));
        assert!(m.llama.layers_half(), "{name}: a layer was widened on load");
        let (worst, same) = compare(&logits(&m), &want);
        println!("{name} GGUF vs f32: largest logit difference {worst:.4} of the largest logit; greedy token the same at {same} of {} positions", want.len());
        assert!(worst < bound, "{name} logits differ from f32 by {worst} of the largest logit (bound {bound})");
        assert!(same * 10 >= want.len() * 9, "{name} agrees with f32 on the greedy token at {same} of {} positions", want.len());
    }
}

fn refused(extra: &[(&str, Value)], extra_tensors: &[&str]) -> String {
    let (_dir, f) = scratch(&format!("refused-{}", extra.len() + extra_tensors.len() * 10));
    write_tiny(&f, |_| GgmlDType::F32, extra, extra_tensors);
    match Model::from_gguf(&f, &Device::Cpu) {
        Ok(_) => panic!("loaded with {:?} {extra_tensors:?}", extra.iter().map(|(k, _)| k).collect::<Vec<_>>()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn what_the_loader_does_not_implement_is_refused_naming_it() {
    let e = refused(&[("llama.expert_count", Value::U32(8))], &[]);
    assert!(e.contains("`llama.expert_count`") && e.contains("does not implement"), "{e}");
    let e = refused(&[("llama.rope.scaling.type", Value::String("yarn".into()))], &[]);
    assert!(e.contains("`llama.rope.scaling.type`") && e.contains("yarn"), "{e}");
    let e = refused(&[("llama.rope.dimension_count", Value::U32(8))], &[]);
    assert!(e.contains("`llama.rope.dimension_count`") && e.contains("head size 16"), "{e}");
    let e = refused(&[], &["rope_freqs.weight"]);
    assert!(e.contains("`rope_freqs.weight`") && e.contains("Llama 3.1"), "{e}");
    let e = refused(&[("general.architecture", Value::String("gpt2".into()))], &[]);
    assert!(e.contains("gpt2") && e.contains("llama, qwen2"), "{e}");
    let e = refused(&[("tokenizer.ggml.model", Value::String("bert".into()))], &[]);
    assert!(e.contains("`tokenizer.ggml.model`") && e.contains("bert"), "{e}");
    let missing = Model::from_gguf(Path::new("/nonexistent/model.gguf"), &Device::Cpu).unwrap_err();
    assert!(matches!(missing, ModelError::MissingFile(_)), "{missing}");
}
