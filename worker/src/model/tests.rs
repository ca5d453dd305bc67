//! Model-level proofs: the paged path equals the contiguous reference, and prefill followed by
//! decode equals recomputing the whole sequence.

use candle_core::{Device, Tensor};

use super::Model;
use super::llama::{SeqStep, to_vec};
use crate::kv::{KvDtype, KvPool};

fn setup(page_size: usize, pages: usize, dtype: KvDtype) -> (Model, std::sync::Arc<KvPool>) {
    let model = Model::tiny(&Device::Cpu).unwrap();
    let pool = KvPool::host(model.kv_layout(page_size, dtype), pages).unwrap();
    (model, pool)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn row(t: &Tensor, i: usize) -> Vec<f32> {
    to_vec(&t.get(i).unwrap()).unwrap()
}

const PROMPT: &str = "The quick brown fox jumps over the lazy dog; paging must not change a thing.";

#[test]
fn paged_prefill_equals_the_contiguous_reference() {
    let (model, pool) = setup(16, 64, KvDtype::F32);
    let tokens = model.tokenizer.encode(PROMPT).unwrap();
    let reference = model.llama.forward_reference(&tokens).unwrap();
    let lease = pool.lease(tokens.len()).unwrap();
    let paged = model.llama.forward(&[SeqStep { tokens: &tokens, start: 0, lease: &lease, every_row: false }], &pool).unwrap();
    let d = max_diff(&row(&paged, 0), &row(&reference, tokens.len() - 1));
    assert!(d < 1e-4, "paged vs contiguous logits differ by {d}");
}

#[test]
fn prefill_then_decode_equals_recomputing_the_sequence() {
    for (dtype, tol) in [(KvDtype::F32, 1e-4), (KvDtype::BF16, 5e-2), (KvDtype::Q8_0, 5e-2)] {
        let (model, pool) = setup(4, 64, dtype);
        let tokens = model.tokenizer.encode(PROMPT).unwrap();
        let split = 21; // not a page boundary
        let lease = pool.lease(tokens.len()).unwrap();
        model.llama.forward(&[SeqStep { tokens: &tokens[..split], start: 0, lease: &lease, every_row: false }], &pool).unwrap();
        let reference = model.llama.forward_reference(&tokens).unwrap();
        for pos in split..tokens.len() {
            let step = SeqStep { tokens: &tokens[pos..pos + 1], start: pos, lease: &lease, every_row: false };
            let logits = model.llama.forward(&[step], &pool).unwrap();
            let d = max_diff(&row(&logits, 0), &row(&reference, pos));
            assert!(d < tol, "{dtype}: position {pos} differs by {d}");
        }
    }
}

#[test]
fn a_batched_step_equals_each_sequence_alone() {
    let (model, pool) = setup(16, 64, KvDtype::F32);
    let a = model.tokenizer.encode("first sequence").unwrap();
    let b = model.tokenizer.encode("a second, longer sequence of bytes").unwrap();
    let (la, lb) = (pool.lease(a.len()).unwrap(), pool.lease(b.len()).unwrap());
    let both = model
        .llama
        .forward(&[SeqStep { tokens: &a, start: 0, lease: &la, every_row: false }, SeqStep { tokens: &b, start: 0, lease: &lb, every_row: false }], &pool)
        .unwrap();
    let ra = model.llama.forward_reference(&a).unwrap();
    let rb = model.llama.forward_reference(&b).unwrap();
    assert!(max_diff(&row(&both, 0), &row(&ra, a.len() - 1)) < 1e-4);
    assert!(max_diff(&row(&both, 1), &row(&rb, b.len() - 1)) < 1e-4);
}

#[test]
fn the_tiny_model_is_the_same_everywhere() {
    let m1 = Model::tiny(&Device::Cpu).unwrap();
    let m2 = Model::tiny(&Device::Cpu).unwrap();
    assert_eq!(m1.fingerprint, m2.fingerprint);
    let tokens = m1.tokenizer.encode("hello").unwrap();
    let l1 = m1.llama.forward_reference(&tokens).unwrap();
    let l2 = m2.llama.forward_reference(&tokens).unwrap();
    assert_eq!(to_vec(&l1).unwrap(), to_vec(&l2).unwrap());
    // Pin a few weights so a change to the generator cannot go unnoticed.
    let w = to_vec(m1.llama.embed.embeddings().expect("a dense table")).unwrap();
    assert_eq!(w.len(), 258 * 64);
    let checksum: f64 = w.iter().map(|x| *x as f64).sum();
    assert!((checksum - TINY_EMBED_SUM).abs() < 1e-3, "tiny embedding sum changed: {checksum}");
}

/// Sum of the tiny model's embedding weights (revision 1).
const TINY_EMBED_SUM: f64 = 119.016_096_341_645_6;
