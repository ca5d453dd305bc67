//! How much of a waiting prompt goes into a step while other sequences are decoding.
//!
//! A step that carries a 2,048-token prompt chunk takes a hundred times a decode-only step, and
//! every running sequence waits for it: one long prompt would stall every stream. Like vLLM's and
//! SGLang's chunked prefill, prompts are split and interleaved with decode steps; unlike a fixed
//! token budget, the chunk here is sized from what steps are measured to cost, so that a step with
//! a prompt chunk takes at most `stall_limit` times a decode-only step. With nothing decoding,
//! prompts get the whole batch budget.

use std::time::Duration;

/// A chunk never shrinks below this (the prompt must progress, and tiny chunks waste a pass).
const MIN_CHUNK: usize = 16;
/// Before anything is measured, a chunk beside running decodes is this long.
const FIRST_CHUNK: usize = 64;
/// Weight of the newest measurement in the running averages.
const ALPHA: f64 = 0.25;

#[derive(Debug, Clone)]
pub struct Pacer {
    stall_limit: f64,
    /// Seconds a decode-only step takes (running average).
    decode_step: Option<f64>,
    /// Seconds each prompt token adds to a step (running average; it grows with context).
    per_prompt_token: Option<f64>,
}

impl Pacer {
    /// `stall_limit`: most a step with a prompt chunk may take, in decode-only steps (at least
    /// 1; `f64::INFINITY` turns pacing off).
    pub fn new(stall_limit: f64) -> Self {
        Pacer { stall_limit: stall_limit.max(1.0), decode_step: None, per_prompt_token: None }
    }

    /// Most prompt tokens to add to a step that also advances `decoding` sequences, out of `budget`.
    pub fn prompt_tokens(&self, decoding: usize, budget: usize) -> usize {
        if decoding == 0 || self.stall_limit.is_infinite() {
            return budget;
        }
        let chunk = match (self.decode_step, self.per_prompt_token) {
            (Some(step), Some(per_token)) => ((self.stall_limit - 1.0) * step / per_token) as usize,
            _ => FIRST_CHUNK,
        };
        chunk.clamp(MIN_CHUNK, budget.max(MIN_CHUNK)).min(budget)
    }

    /// Most prompt tokens in a step while tenants share the engine: as many as take `step` at
    /// the measured cost per prompt token (another tenant's request that arrives while the
    /// chunk runs waits for no more).
    pub fn shared_prompt_tokens(&self, step: Duration, budget: usize) -> usize {
        let chunk = self.per_prompt_token.map_or(FIRST_CHUNK, |t| (step.as_secs_f64() / t) as usize);
        chunk.clamp(MIN_CHUNK, budget.max(MIN_CHUNK)).min(budget)
    }

    /// Records what a step cost: `decoding` one-token sequences and `prompt` prompt tokens.
    pub fn record(&mut self, decoding: usize, prompt: usize, took: Duration) {
        let took = took.as_secs_f64();
        if prompt == 0 {
            if decoding > 0 {
                self.decode_step = Some(average(self.decode_step, took));
            }
            return;
        }
        let base = if decoding > 0 { self.decode_step.unwrap_or(0.0) } else { 0.0 };
        let per_token = ((took - base) / prompt as f64).max(1e-9);
        self.per_prompt_token = Some(average(self.per_prompt_token, per_token));
    }
}

fn average(old: Option<f64>, new: f64) -> f64 {
    old.map_or(new, |o| o + ALPHA * (new - o))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn with_nothing_decoding_a_prompt_gets_the_whole_budget() {
        let p = Pacer::new(2.0);
        assert_eq!(p.prompt_tokens(0, 2048), 2048);
    }

    #[test]
    fn a_chunk_beside_decodes_costs_about_the_limit() {
        let mut p = Pacer::new(2.0);
        assert_eq!(p.prompt_tokens(8, 2048), FIRST_CHUNK, "nothing measured yet");
        p.record(8, 0, 2 * MS); // a decode-only step: 2 ms
        p.record(8, 64, 2 * MS + 64 * Duration::from_micros(50)); // 50 us per prompt token
        // (2 - 1) x 2 ms of prompt at 50 us a token: 40 tokens.
        assert_eq!(p.prompt_tokens(8, 2048), 40);
        // Prompt tokens getting dearer (a longer context) shrink the chunk, never below the floor.
        for _ in 0..50 {
            p.record(8, 40, 2 * MS + 40 * MS);
        }
        assert_eq!(p.prompt_tokens(8, 2048), MIN_CHUNK);
    }

    #[test]
    fn a_shared_chunk_takes_about_the_shared_step() {
        let mut p = Pacer::new(f64::INFINITY);
        assert_eq!(p.shared_prompt_tokens(10 * MS, 2048), FIRST_CHUNK, "nothing measured yet");
        p.record(0, 2048, 2048 * Duration::from_micros(50));
        assert_eq!(p.shared_prompt_tokens(10 * MS, 2048), 200, "10 ms at 50 us a token");
        assert_eq!(p.shared_prompt_tokens(10 * MS, 100), 100);
    }

    #[test]
    fn a_chunk_never_exceeds_the_budget_and_pacing_can_be_off() {
        let mut p = Pacer::new(100.0);
        p.record(1, 0, 10 * MS);
        p.record(1, 10, 10 * MS + 10 * Duration::from_micros(1));
        assert_eq!(p.prompt_tokens(1, 512), 512);
        assert_eq!(Pacer::new(f64::INFINITY).prompt_tokens(8, 2048), 2048);
        assert_eq!(Pacer::new(2.0).prompt_tokens(8, 8), 8, "a budget below the floor is still the cap");
    }
}
