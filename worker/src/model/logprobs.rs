//! Log-probabilities from one row of logits: what `logprobs`, `top_logprobs` and `echo` report.

use kvgate_proto::logprobs::TokenLogprobs;

/// `chosen`'s log-probability under `logits`, and the `top` most likely tokens (ties by lower
/// id). Computed from the raw logits, before temperature or top-p, as OpenAI reports them.
pub fn token_logprobs(logits: &[f32], chosen: u32, top: usize) -> TokenLogprobs {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|l| (*l as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    let logprob = |id: usize| (logits[id] as f64 - lse) as f32;
    let mut best: Vec<u32> = Vec::with_capacity(top + 1);
    if top > 0 {
        for id in 0..logits.len() as u32 {
            let better = |other: &u32| logits[id as usize] > logits[*other as usize];
            let at = best.iter().position(better).unwrap_or(best.len());
            if at < top {
                best.insert(at, id);
                best.truncate(top);
            }
        }
    }
    TokenLogprobs { logprob: logprob(chosen as usize), top: best.into_iter().map(|id| (id, logprob(id as usize))).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_normalised_and_top_is_ordered() {
        let l = token_logprobs(&[1.0, 3.0, 3.0, 0.0], 0, 2);
        let total: f64 = [1.0f64, 3.0, 3.0, 0.0].iter().map(|x| x.exp()).sum();
        assert!((l.logprob as f64 - (1.0 - total.ln())).abs() < 1e-6);
        assert_eq!(l.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2], "ties go to the lower id");
        assert!(token_logprobs(&[0.0; 4], 3, 0).top.is_empty());
    }
}
