//! Random GGUF files of Llama and Qwen2 in Q8_0 or Q4_K_M's mix, and llama.cpp's server from the
//! pinned `xllamacpp` wheel: what `tests/gguf.rs` compares kvgate with and `benches/gguf.rs`
//! measures it against.

#![allow(dead_code)] // the test and the bench each use a part

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// A model's dimensions.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub layers: usize,
    /// Three specials, then pieces `t3`, `t4`, ... (and, for BPE, the newline llama.cpp looks
    /// up and a merge of two of them, since it refuses a BPE vocabulary without merges).
    pub vocab: usize,
}

#[derive(Clone, Copy, Debug)]
pub enum Family {
    Llama,
    Qwen2,
}

#[derive(Clone, Copy, Debug)]
pub enum Mix {
    Q8_0,
    Q4KM,
    F16,
}

impl Mix {
    fn dtype(self, name: &str) -> GgmlDType {
        match self {
            Mix::Q8_0 => GgmlDType::Q8_0,
            // llama.cpp's Q4_K_M keeps V, the down projection and the output layer in Q6_K.
            Mix::Q4KM if name.contains("attn_v") || name.contains("ffn_down") || name == "output.weight" => GgmlDType::Q6K,
            Mix::Q4KM => GgmlDType::Q4K,
            Mix::F16 => GgmlDType::F16,
        }
    }
}

/// Uniform numbers from a fixed seed (the same file on every run).
struct Rng(u64);

impl Rng {
    fn tensor(&mut self, shape: &[usize], scale: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }
}

/// A token id as its piece can be read back (`piece`): itself, or `None` for the three
/// specials, whose text does not tell them apart.
pub fn key(id: u32) -> Option<u32> {
    (id > 2).then_some(id)
}

/// The token id a piece of `write`'s vocabulary of `vocab` decodes from: `t<id>`, Qwen2's two
/// newlines (its last two ids); `None` for the three specials (no text, or `<unk>`).
pub fn piece(text: &str, vocab: usize) -> Option<u32> {
    match text {
        "\n" => Some((vocab - 2) as u32),
        "\n\n" => Some((vocab - 1) as u32),
        "" | "<unk>" => None,
        t => Some(t.strip_prefix('t').and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("not a fixture piece: {t:?}"))),
    }
}

/// Writes a random model of `shape` to `path`.
pub fn write(path: &Path, shape: Shape, family: Family, mix: Mix) {
    let Shape { hidden, ffn, heads, kv_heads, layers, vocab } = shape;
    let mut rng = Rng(0x6767_7566 + family as u64 * 7 + mix as u64);
    let hd = hidden / heads;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut add = |name: String, shape: &[usize], rng: &mut Rng| {
        let fan_in = *shape.last().unwrap() as f32;
        let scale = if name.starts_with("token_embd") { 4.0 * (3.0 / fan_in).sqrt() } else { (3.0 / fan_in).sqrt() };
        let t = rng.tensor(shape, scale);
        let dtype = if shape.len() == 2 { mix.dtype(&name) } else { GgmlDType::F32 };
        tensors.push((name, QTensor::quantize(&t, dtype).unwrap()));
    };
    add("token_embd.weight".into(), &[vocab, hidden], &mut rng);
    add("output.weight".into(), &[vocab, hidden], &mut rng);
    for i in 0..layers {
        for (t, shape) in [
            ("attn_q.weight", vec![heads * hd, hidden]),
            ("attn_k.weight", vec![kv_heads * hd, hidden]),
            ("attn_v.weight", vec![kv_heads * hd, hidden]),
            ("attn_output.weight", vec![hidden, heads * hd]),
            ("ffn_gate.weight", vec![ffn, hidden]),
            ("ffn_up.weight", vec![ffn, hidden]),
            ("ffn_down.weight", vec![hidden, ffn]),
        ] {
            add(format!("blk.{i}.{t}"), &shape, &mut rng);
        }
        if matches!(family, Family::Qwen2) {
            for (t, n) in [("attn_q.bias", heads * hd), ("attn_k.bias", kv_heads * hd), ("attn_v.bias", kv_heads * hd)] {
                add(format!("blk.{i}.{t}"), &[n], &mut rng);
            }
        }
    }
    let ones = |n: usize| QTensor::quantize(&Tensor::ones(n, candle_core::DType::F32, &Device::Cpu).unwrap(), GgmlDType::F32).unwrap();
    for i in 0..layers {
        tensors.push((format!("blk.{i}.attn_norm.weight"), ones(hidden)));
        tensors.push((format!("blk.{i}.ffn_norm.weight"), ones(hidden)));
    }
    tensors.push(("output_norm.weight".into(), ones(hidden)));

    let arch = match family {
        Family::Llama => "llama",
        Family::Qwen2 => "qwen2",
    };
    let u = |n: usize| Value::U32(n as u32);
    let s = |t: &str| Value::String(t.into());
    let mut pieces: Vec<Value> = ["<unk>", "<s>", "</s>"].iter().map(|p| s(p)).collect();
    pieces.extend((3..vocab - 1).map(|i| s(&format!("t{i}"))));
    let mut types: Vec<Value> = vec![Value::I32(2), Value::I32(3), Value::I32(3)];
    types.extend((3..vocab).map(|_| Value::I32(1)));
    let key = |k: &str| format!("{arch}.{k}");
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), s(arch)),
        (key("context_length"), u(16384)),
        (key("embedding_length"), u(hidden)),
        (key("block_count"), u(layers)),
        (key("feed_forward_length"), u(ffn)),
        (key("attention.head_count"), u(heads)),
        (key("attention.head_count_kv"), u(kv_heads)),
        (key("rope.dimension_count"), u(hd)),
        (key("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        (key("rope.freq_base"), Value::F32(10000.0)),
        ("tokenizer.ggml.bos_token_id".into(), u(1)),
        ("tokenizer.ggml.eos_token_id".into(), u(2)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ];
    match family {
        Family::Llama => {
            pieces.push(s(&format!("t{}", vocab - 1)));
            meta.push(("tokenizer.ggml.model".into(), s("llama")));
            meta.push(("tokenizer.ggml.scores".into(), Value::Array(vec![Value::F32(0.0); vocab])));
        }
        Family::Qwen2 => {
            pieces.pop();
            pieces.extend([s("\u{10a}"), s("\u{10a}\u{10a}")]);
            meta.push(("tokenizer.ggml.model".into(), s("gpt2")));
            meta.push(("tokenizer.ggml.pre".into(), s("qwen2")));
            meta.push(("tokenizer.ggml.merges".into(), Value::Array(vec![s("\u{10a} \u{10a}")])));
        }
    }
    meta.push(("tokenizer.ggml.tokens".into(), Value::Array(pieces)));
    meta.push(("tokenizer.ggml.token_type".into(), Value::Array(types)));
    let meta: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &meta, &tensors).unwrap();
}

/// llama.cpp's server from the pinned wheel, killed when dropped.
pub use kvgate_testenv::llamacpp::Server as LlamaCpp;

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// llama.cpp's server for `model` on a free loopback port, with `args` (`-c`, `-np`, `-t` ...),
/// once it answers (`kvgate_testenv::llamacpp::start`, off the async runtime's threads).
pub async fn llama_server(model: &Path, args: &[&str]) -> LlamaCpp {
    let (model, args) = (model.to_path_buf(), args.iter().map(|a| a.to_string()).collect::<Vec<_>>());
    tokio::task::spawn_blocking(move || kvgate_testenv::llamacpp::start(&model, &args.iter().map(String::as_str).collect::<Vec<_>>())).await.unwrap()
}
