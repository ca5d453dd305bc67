//! Picking the next token: greedy, or temperature + top-p with a seeded generator.

use kvgate_proto::roles::Sampling;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
    pub seed: Option<u64>,
    /// Report each generated token's log-probability and this many alternatives.
    pub logprobs: Option<u8>,
    /// Report the log-probability of every prompt token (`echo` with `logprobs`).
    pub prompt_logprobs: bool,
    /// Generate past the model's end-of-sequence tokens, up to `max_tokens` (vLLM's extension,
    /// which load generators send to fix output lengths).
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_p: 1.0, seed: None, logprobs: None, prompt_logprobs: false, ignore_eos: false }
    }
}

impl From<Sampling> for SamplingParams {
    fn from(s: Sampling) -> Self {
        SamplingParams {
            temperature: s.temperature,
            top_p: s.top_p,
            seed: s.seed,
            logprobs: s.logprobs,
            prompt_logprobs: s.prompt_logprobs,
            ignore_eos: s.ignore_eos,
        }
    }
}

impl From<SamplingParams> for Sampling {
    fn from(s: SamplingParams) -> Self {
        Sampling {
            temperature: s.temperature,
            top_p: s.top_p,
            seed: s.seed,
            logprobs: s.logprobs,
            prompt_logprobs: s.prompt_logprobs,
            ignore_eos: s.ignore_eos,
        }
    }
}

#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(seed) => ChaCha8Rng::seed_from_u64(seed),
            None => ChaCha8Rng::from_os_rng(),
        };
        Sampler { params, rng }
    }

    /// Moves the generator past `n` samples drawn elsewhere (prefill drew the first token).
    pub fn skip(&mut self, n: usize) {
        if self.params.temperature > 0.0 {
            for _ in 0..n {
                let _: f32 = self.rng.random();
            }
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        let t = self.params.temperature;
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, l)| (i as u32, ((l - max) / t).exp())).collect();
        let total: f32 = probs.iter().map(|p| p.1).sum();
        probs.iter_mut().for_each(|p| p.1 /= total);
        if self.params.top_p < 1.0 {
            probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let mut cum = 0.0;
            let keep = probs
                .iter()
                .position(|p| {
                    cum += p.1;
                    cum >= self.params.top_p
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
        }
        let mass: f32 = probs.iter().map(|p| p.1).sum();
        let mut x = self.rng.random::<f32>() * mass;
        for (id, p) in &probs {
            if x < *p {
                return *id;
            }
            x -= p;
        }
        probs.last().map_or(0, |p| p.0)
    }
}

/// Index of the largest logit; the lowest index wins a tie.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, l) in logits.iter().enumerate() {
        if *l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.0, 0.5, 0.2]), 1);
    }

    #[test]
    fn a_seed_makes_sampling_repeatable() {
        let p = SamplingParams { temperature: 1.0, top_p: 1.0, seed: Some(7), ..Default::default() };
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let a: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..32).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..32).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().any(|t| *t != a[0]), "temperature 1 over a flat-ish distribution must vary");
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // One token holds 90% of the mass: top_p 0.5 must always pick it.
        let logits = [10.0, 7.8, 0.0, 0.0];
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_p: 0.5, seed: Some(1), ..Default::default() });
        assert!((0..200).all(|_| s.sample(&logits) == 0));
    }
}
