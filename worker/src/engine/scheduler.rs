//! The continuous-batching loop: every step, waiting requests join as soon as their pages are
//! free, prompts are prefilled in chunks under a token budget, and every running sequence
//! advances by one token in the same batched forward pass. Between tenants, the least-served
//! goes first for pages, prompt chunks and decode slots (`fair_share`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use super::admission::Rejection;
use super::fair_share::FairShare;
use super::pacing::Pacer;
use super::request::{Event, Failure, FinishReason, GenerateRequest, Mode};
use super::sequence::Sequence;
use crate::kv::{AllocError, KvPool};
use crate::metrics::Metrics;
use crate::model::logprobs::token_logprobs;
use crate::model::{Model, SeqStep};

/// Most prompt tokens per step for a sequence whose every row of logits is kept (`echo` with
/// `logprobs`): bounds the logits held at once to this many rows of the vocabulary.
const EVERY_ROW_CHUNK: usize = 64;

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    /// Most prompt + decode tokens in one forward pass.
    pub max_batch_tokens: usize,
    /// How long a request may wait for free pages before it gets 503.
    pub admission_timeout: Duration,
    /// While sequences decode, a step with a prompt chunk takes at most this many decode-only
    /// steps (`f64::INFINITY`: chunks take the whole batch budget). See `pacing`.
    pub stall_limit: f64,
    /// While more than one tenant has work, a prompt chunk takes about this long at most
    /// (`None`: whole chunks). See `fair_share`.
    pub shared_step: Option<Duration>,
}

pub struct Scheduler {
    pub model: Arc<Model>,
    pub pool: Arc<KvPool>,
    pub metrics: Metrics,
    pub config: SchedulerConfig,
    waiting: VecDeque<GenerateRequest>,
    running: Vec<Sequence>,
    pacer: Pacer,
    fair: FairShare,
}

impl Scheduler {
    pub fn new(model: Arc<Model>, pool: Arc<KvPool>, metrics: Metrics, config: SchedulerConfig) -> Self {
        let pacer = Pacer::new(config.stall_limit);
        Scheduler { model, pool, metrics, config, waiting: VecDeque::new(), running: Vec::new(), pacer, fair: FairShare::default() }
    }

    /// Runs until every sender of `inbox` is gone and all work is done.
    pub fn run(mut self, inbox: Receiver<GenerateRequest>) {
        loop {
            let idle = self.running.is_empty() && self.waiting.is_empty();
            let received = if idle {
                inbox.recv().map_err(|_| RecvTimeoutError::Disconnected)
            } else if self.running.is_empty() {
                // Only waiting requests: poll for freed pages without spinning.
                inbox.recv_timeout(Duration::from_millis(2))
            } else {
                inbox.try_recv().map_err(|e| match e {
                    std::sync::mpsc::TryRecvError::Empty => RecvTimeoutError::Timeout,
                    std::sync::mpsc::TryRecvError::Disconnected => RecvTimeoutError::Disconnected,
                })
            };
            match received {
                Ok(req) => {
                    for req in std::iter::once(req).chain(inbox.try_iter()) {
                        self.fair.join(&req.tenant);
                        self.waiting.push_back(req);
                    }
                }
                Err(RecvTimeoutError::Disconnected) if idle => return,
                Err(_) => {}
            }
            self.admit();
            self.publish_load();
            if !self.running.is_empty() {
                self.step();
                self.publish_load();
            }
        }
    }

    /// What an endpoint picker reads: running and queued requests.
    fn publish_load(&self) {
        self.metrics.running.set(self.running.len() as i64);
        self.metrics.waiting.set(self.waiting.len() as i64);
    }

    /// Moves waiting requests into the running set: continued ones at once (they bring their
    /// pages), the others while pages last, the least-served tenant's first and each tenant's
    /// in arrival order. The one chosen waits at the head for its pages (a large request is not
    /// passed over for ever by smaller ones).
    fn admit(&mut self) {
        self.waiting.retain(|req| !req.events.is_closed());
        let (continued, fresh): (VecDeque<GenerateRequest>, VecDeque<GenerateRequest>) =
            std::mem::take(&mut self.waiting).into_iter().partition(|r| matches!(r.mode, Mode::Continue { .. }));
        self.waiting = fresh;
        for req in continued {
            self.continue_handoff(req);
        }
        while !self.waiting.is_empty() {
            let next = (0..self.waiting.len()).min_by_key(|&i| self.fair.priority(&self.waiting[i].tenant)).expect("not empty");
            let req = &self.waiting[next];
            let tokens = match req.mode {
                Mode::PrefillOnly { .. } => req.prompt.len(),
                _ => req.prompt.len() + req.max_tokens,
            };
            match self.pool.lease(tokens) {
                Ok(lease) => {
                    let req = self.waiting.remove(next).expect("an index of waiting");
                    self.metrics.prompt_tokens.inc_by(req.prompt.len() as u64);
                    self.running.push(Sequence::new(req, lease));
                }
                Err(AllocError::NeverFits { requested, total }) => {
                    // Admission already checks this; keep the pool's word as the last one.
                    let req = self.waiting.remove(next).expect("an index of waiting");
                    let page = self.pool.layout().page_size;
                    let _ = req.events.send(Event::Rejected(Rejection::NeverFits {
                        prompt: req.prompt.len(),
                        max_tokens: req.max_tokens,
                        needed: requested * page,
                        capacity: total * page,
                    }));
                }
                Err(AllocError::Insufficient { .. }) => break,
            }
        }
        let timeout = self.config.admission_timeout;
        self.waiting.retain(|req| {
            let waited = req.arrived.elapsed();
            if waited < timeout {
                return true;
            }
            let _ = req.events.send(Event::Rejected(Rejection::pool_busy(waited)));
            false
        });
    }

    /// A request whose prompt's KV arrived by handoff: it runs at once from its first token.
    fn continue_handoff(&mut self, mut req: GenerateRequest) {
        let Mode::Continue { lease, first_token, first_logprobs } = std::mem::replace(&mut req.mode, Mode::Full) else {
            unreachable!("only continued requests come here")
        };
        self.metrics.prompt_tokens.inc_by(req.prompt.len() as u64);
        let s = Sequence::continued(req, lease, first_token);
        s.send(Event::Token(first_token, first_logprobs));
        self.metrics.generation_tokens.inc();
        // The first token may already end it (end of sequence, or max_tokens 1), exactly as it
        // would have colocated.
        match s.finished(&self.model.eos) {
            Some(finish) => self.complete(s, finish),
            None => self.running.push(s),
        }
    }

    /// One batched forward pass over every running sequence. A sequence whose step cannot run
    /// (a token outside the vocabulary, a position past its lease, any model error) fails alone:
    /// the others of the batch produce exactly what they would have without it.
    fn step(&mut self) {
        self.running.retain(|s| !s.client_gone());
        let mut budget = self.config.max_batch_tokens;
        // (index into running, tokens this step)
        let mut plan: Vec<(usize, usize)> = Vec::new();
        let mut failed: Vec<(usize, String)> = Vec::new();
        // Decodes first: a running sequence must never stall behind a long prompt. Prompt
        // chunks beside them are sized so the step stays within the stall limit.
        let (mut decoding, mut prefilling): (Vec<usize>, Vec<usize>) = (0..self.running.len()).partition(|&i| self.running[i].pending() == 1);
        // Within each kind, the least-served tenant's first (stable: arrival order within one).
        decoding.sort_by_key(|&i| self.fair.priority(&self.running[i].req.tenant));
        prefilling.sort_by_key(|&i| self.fair.priority(&self.running[i].req.tenant));
        let decodes = decoding.len().min(budget);
        let mut prompt_budget = self.pacer.prompt_tokens(decodes, budget - decodes);
        if let Some(step) = self.config.shared_step
            && self.fair.shared(Instant::now())
        {
            prompt_budget = prompt_budget.min(self.pacer.shared_prompt_tokens(step, budget - decodes));
        }
        let (mut prompt_tokens, mut decode_tokens) = (0, 0);
        for i in decoding.into_iter().chain(prefilling) {
            let decode = self.running[i].pending() == 1;
            if budget == 0 || (!decode && prompt_budget == 0) {
                break;
            }
            // A prompt whose log-probabilities are wanted keeps every row: smaller chunks.
            let cap = if self.running[i].wants_every_row() { EVERY_ROW_CHUNK } else { usize::MAX };
            let n = if decode { 1 } else { self.running[i].pending().min(budget).min(prompt_budget).min(cap) };
            match self.running[i].check_step(n, self.model.vocab_size()) {
                Ok(()) => {
                    budget -= n;
                    if decode {
                        decode_tokens += 1;
                    } else {
                        prompt_budget -= n;
                        prompt_tokens += n;
                    }
                    plan.push((i, n));
                }
                Err(why) => failed.push((i, why.to_string())),
            }
        }
        // One span per prompt chunk in this pass, under its request's span (a trace shows how
        // a long prompt was split and what it shared its passes with).
        let chunks: Vec<tracing::Span> = plan
            .iter()
            .filter(|&&(i, _)| self.running[i].cached < self.running[i].prompt_len())
            .map(|&(i, n)| {
                let s = &self.running[i];
                tracing::info_span!(parent: &s.req.span, "prefill_chunk", tokens = n as i64, start = s.cached as i64, batch_sequences = plan.len() as i64)
            })
            .collect();
        for &(i, n) in &plan {
            self.fair.charge(&self.running[i].req.tenant, n as u64);
        }
        let started = Instant::now();
        let rows = if plan.is_empty() { Vec::new() } else { self.forward_isolating(&plan) };
        self.pacer.record(decode_tokens, prompt_tokens, started.elapsed());
        drop(chunks);
        let mut sampled = Vec::with_capacity(plan.len());
        for (&(i, n), row) in plan.iter().zip(rows) {
            match row {
                Ok(logits) => sampled.push((i, n, logits)),
                Err(e) => failed.push((i, format!("model step failed: {e}"))),
            }
        }
        for (i, why) in &failed {
            tracing::warn!(error = %why, "failing one sequence; the rest of its batch goes on");
            self.running[*i].send(Event::Failed(Failure::internal(why.clone())));
        }
        self.sample(&sampled);
        let failed: Vec<usize> = failed.into_iter().map(|(i, _)| i).collect();
        let mut index = 0..;
        self.running.retain(|_| !failed.contains(&index.next().unwrap()));
        self.finish_done();
        self.fair.keep_only(self.running.iter().map(|s| &s.req.tenant).chain(self.waiting.iter().map(|r| &r.tenant)));
    }

    /// Runs `plan` as one batch. Should the batch fail, each sequence is run alone, so that
    /// only the one that really fails does (its earlier K/V writes are idempotent: the same
    /// tokens at the same positions). One row of logits (or an error) per planned sequence;
    /// a prefill chunk that samples nothing gets an empty row.
    fn forward_isolating(&mut self, plan: &[(usize, usize)]) -> Vec<Result<Vec<Vec<f32>>, String>> {
        match self.forward(plan) {
            Ok(rows) => rows.into_iter().map(Ok).collect(),
            Err(e) if plan.len() == 1 => vec![Err(e)],
            Err(_) => plan.iter().map(|p| self.forward(std::slice::from_ref(p)).map(|mut rows| rows.remove(0))).collect(),
        }
    }

    /// Each planned sequence's rows of logits: its last token's, or every token's when its
    /// prompt log-probabilities are wanted.
    fn forward(&mut self, plan: &[(usize, usize)]) -> Result<Vec<Vec<Vec<f32>>>, String> {
        let steps: Vec<SeqStep> = plan
            .iter()
            .map(|&(i, n)| {
                let s = &self.running[i];
                SeqStep { tokens: &s.tokens[s.cached..s.cached + n], start: s.cached, lease: &s.lease, every_row: s.wants_every_row() }
            })
            .collect();
        let counts: Vec<usize> = steps.iter().map(|s| if s.every_row { s.tokens.len() } else { 1 }).collect();
        let logits = self.model.llama.forward(&steps, &self.pool).map_err(|e| e.to_string())?;
        let mut rows = (0..).map(|r| logits.get(r).and_then(|r| r.to_vec1::<f32>()).map_err(|e| format!("reading logits: {e}")));
        counts.into_iter().map(|c| rows.by_ref().take(c).collect()).collect()
    }

    /// Frees a finished sequence's pages (scrubbed), *then* tells the client: by the time an
    /// answer arrives, its KV is gone.
    fn complete(&mut self, s: Sequence, finish: FinishReason) {
        self.metrics.duration.observe(s.req.arrived.elapsed().as_secs_f64());
        let done = Event::Done { finish, prompt_tokens: s.prompt_len(), completion_tokens: s.generated() };
        let events = s.req.events.clone();
        drop(s);
        let _ = events.send(done);
    }

    /// Advances each sequence past the tokens it ran, and samples the next token of those that
    /// ran their last pending one.
    fn sample(&mut self, stepped: &[(usize, usize, Vec<Vec<f32>>)]) {
        let now = Instant::now();
        for (i, n, rows) in stepped {
            let s = &mut self.running[*i];
            let top = s.req.sampling.logprobs.map(usize::from);
            if s.wants_every_row() {
                // Row j predicts the prompt token after position cached + j (the last row, at
                // the prompt's end, predicts the first generated one).
                let k = top.unwrap_or(0);
                let next = s.req.prompt.get(s.cached + 1..).unwrap_or_default();
                let scored = rows.iter().zip(next).map(|(row, t)| Some(token_logprobs(row, *t, k)));
                s.prompt_logprobs.as_mut().expect("wanted: see wants_every_row").extend(scored);
            }
            s.cached += n;
            if s.pending() > 0 {
                continue; // prompt chunk: nothing to sample yet
            }
            let row_logits = rows.last().expect("a step yields at least one row");
            let token = s.sampler.sample(row_logits);
            s.tokens.push(token);
            let logprobs = top.map(|k| token_logprobs(row_logits, token, k));
            if s.is_prefill_only() {
                s.first_logprobs = logprobs;
                continue; // the first token travels with the handoff, not to a client
            }
            if s.generated() == 1
                && let Some(prompt) = s.prompt_logprobs.take()
            {
                s.send(Event::PromptLogprobs(prompt));
            }
            match s.last_token_at {
                None => self.metrics.ttft.observe((now - s.req.arrived).as_secs_f64()),
                Some(prev) => self.metrics.inter_token.observe((now - prev).as_secs_f64()),
            }
            s.last_token_at = Some(now);
            self.metrics.generation_tokens.inc();
            s.send(Event::Token(token, logprobs));
        }
    }

    /// Hands back finished prefill-only sequences and completes every finished sequence.
    fn finish_done(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].is_prefill_only() && self.running[i].generated() > 0 {
                let s = self.running.remove(i);
                s.hand_back();
                continue;
            }
            match self.running[i].finished(&self.model.eos) {
                Some(finish) => {
                    let s = self.running.remove(i);
                    self.complete(s, finish);
                }
                None => i += 1,
            }
        }
    }
}
