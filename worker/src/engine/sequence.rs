//! One running request inside the scheduler: its tokens, its pages and its progress.

use std::time::Instant;

use super::request::{Event, FinishReason, GenerateRequest, Mode, Prefilled};
use kvgate_proto::logprobs::TokenLogprobs;

use crate::kv::Lease;
use crate::model::Sampler;

#[derive(Debug)]
pub struct Sequence {
    pub req: GenerateRequest,
    pub lease: Lease,
    pub sampler: Sampler,
    /// Prompt followed by every token generated so far.
    pub tokens: Vec<u32>,
    /// Tokens whose K/V are already in the pool.
    pub cached: usize,
    pub last_token_at: Option<Instant>,
    /// The prompt tokens' log-probabilities so far, when the request asked for them.
    pub prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
    /// The first token's, kept for a prefill-only sequence's handoff.
    pub first_logprobs: Option<TokenLogprobs>,
}

impl Sequence {
    pub fn new(req: GenerateRequest, lease: Lease) -> Self {
        let prompt_logprobs = req.sampling.prompt_logprobs.then(|| vec![None]);
        Sequence {
            sampler: crate::model::Sampler::new(req.sampling),
            tokens: req.prompt.clone(),
            req,
            lease,
            cached: 0,
            last_token_at: None,
            prompt_logprobs,
            first_logprobs: None,
        }
    }

    /// A sequence whose prompt KV arrived by handoff: the prompt is cached, the first token known
    /// (prefill sampled it from the same seed, so the generator moves past that draw).
    pub fn continued(req: GenerateRequest, lease: Lease, first_token: u32) -> Self {
        let mut s = Sequence::new(req, lease);
        s.sampler.skip(1);
        s.cached = s.tokens.len();
        s.tokens.push(first_token);
        s
    }

    /// Whether this step's rows must all be kept: the prompt's log-probabilities are wanted and
    /// the prompt is not done.
    pub fn wants_every_row(&self) -> bool {
        self.prompt_logprobs.is_some() && self.cached < self.prompt_len()
    }

    pub fn is_prefill_only(&self) -> bool {
        matches!(self.req.mode, Mode::PrefillOnly { .. })
    }

    /// Gives a prefill-only sequence's pages and first token to whoever asked for them.
    pub fn hand_back(self) {
        let Sequence { req, lease, tokens, prompt_logprobs, first_logprobs, .. } = self;
        if let Mode::PrefillOnly { reply } = req.mode {
            let _ = reply.send(Prefilled { lease, first_token: *tokens.last().unwrap(), first_logprobs, prompt_logprobs });
        }
    }

    pub fn prompt_len(&self) -> usize {
        self.req.prompt.len()
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len()
    }

    /// Tokens still to be run through the model before the next sample.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.cached
    }

    /// Whether the next `n` pending tokens can run: each one a token of the model, each
    /// position inside the lease. Checked before the batch so one bad sequence cannot fail it.
    pub fn check_step(&self, n: usize, vocab: usize) -> Result<(), StepError> {
        if let Some(&token) = self.tokens[self.cached..self.cached + n].iter().find(|t| **t as usize >= vocab) {
            return Err(StepError::OutsideVocabulary { token, vocab });
        }
        let end = self.cached + n;
        if end > self.lease.capacity() {
            return Err(StepError::PastLease { position: end - 1, leased: self.lease.capacity() });
        }
        Ok(())
    }

    pub fn client_gone(&self) -> bool {
        self.req.events.is_closed()
    }

    /// Why this sequence is complete, if it is (an end-of-sequence token counts unless the
    /// request asked to ignore it).
    pub fn finished(&self, eos: &[u32]) -> Option<FinishReason> {
        if self.generated() > 0 && !self.req.sampling.ignore_eos && eos.contains(self.tokens.last().unwrap()) {
            Some(FinishReason::Stop)
        } else if self.generated() >= self.req.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    pub fn send(&self, event: Event) {
        // A closed channel means the client left; the scheduler notices and frees the pages.
        let _ = self.req.events.send(event);
    }
}

/// Why a sequence's next step cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    #[error("token {token} is outside the vocabulary of {vocab} tokens")]
    OutsideVocabulary { token: u32, vocab: usize },
    #[error("position {position} is past the {leased} tokens leased")]
    PastLease { position: usize, leased: usize },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvDtype, KvLayout, KvPool};
    use crate::model::SamplingParams;

    const EOS: u32 = 9;

    /// A sequence of prompt `[1, 2]` that generated `generated`, asking for 4 tokens.
    fn after(generated: &[u32], ignore_eos: bool) -> Sequence {
        let layout = KvLayout { num_layers: 1, num_kv_heads: 1, head_dim: 2, page_size: 4, dtype: KvDtype::F32 };
        let lease = KvPool::host(layout, 4).unwrap().lease(8).unwrap();
        let (events, _) = tokio::sync::mpsc::unbounded_channel();
        let sampling = SamplingParams { ignore_eos, ..Default::default() };
        let req = GenerateRequest {
            prompt: vec![1, 2],
            max_tokens: 4,
            sampling,
            arrived: Instant::now(),
            events,
            mode: Mode::Full,
            tenant: "test".into(),
            span: tracing::Span::none(),
        };
        let mut s = Sequence::new(req, lease);
        s.tokens.extend_from_slice(generated);
        s
    }

    #[test]
    fn an_end_of_sequence_token_stops_unless_the_request_ignores_it() {
        assert_eq!(after(&[5, EOS], false).finished(&[EOS]), Some(FinishReason::Stop));
        assert_eq!(after(&[5, EOS], true).finished(&[EOS]), None);
        assert_eq!(after(&[5, EOS, EOS, 7], true).finished(&[EOS]), Some(FinishReason::Length));
        // A prompt ending in one is no reason to stop.
        assert_eq!(after(&[], false).finished(&[2]), None);
    }
}
