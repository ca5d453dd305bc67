//! How fast this prefill worker computes prompts, measured once at start: a prompt of `n` tokens
//! and one of `2n`, after a small warm-up. The capacity report carries both timings, and the
//! operator extrapolates them to the declared window: a window that cannot be prefilled before
//! the handoff deadline would have its long prompts answered 504 `prefill_deadline_exceeded`,
//! and the operator says so in the deployment's status.

use std::time::Instant;

use kvgate_proto::PrefillTimings;

use crate::engine::{Engine, Mode};
use crate::model::SamplingParams;

/// Timings of a prompt of `largest / 2` tokens and one of `largest` (none when `largest` < 2).
pub async fn measure(engine: &Engine, largest: usize) -> Option<PrefillTimings> {
    let half = largest / 2;
    if half == 0 {
        return None;
    }
    let vocab = engine.model.vocab_size();
    let prompt = |n: usize| -> Vec<u32> { (0..n).map(|i| ((i * 7919 + 3) % vocab) as u32).collect() };
    prefill(engine, prompt(half.min(32))).await?; // threads and caches warm, not measured
    let mut micros = [0u64; 2];
    for (slot, n) in micros.iter_mut().zip([half, 2 * half]) {
        let started = Instant::now();
        prefill(engine, prompt(n)).await?;
        *slot = started.elapsed().as_micros() as u64;
    }
    Some(PrefillTimings { tokens: [half as u64, 2 * half as u64], micros })
}

/// Prefills `prompt` and frees its pages.
async fn prefill(engine: &Engine, prompt: Vec<u32>) -> Option<()> {
    let (reply, done) = tokio::sync::oneshot::channel();
    let _events = engine.enqueue(prompt, 1, SamplingParams::default(), Mode::PrefillOnly { reply }, "kvgate-prefill-probe");
    done.await.ok().map(drop)
}
