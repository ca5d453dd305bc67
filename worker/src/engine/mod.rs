//! The generation engine: admission in the caller's thread, the model on its own thread.

pub mod admission;
mod fair_share;
mod pacing;
pub mod request;
pub mod scheduler;
mod sequence;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use tokio::sync::mpsc;

pub use admission::{Limits, Rejection};
pub use request::{Event, Failure, FinishReason, GenerateRequest, Mode, Prefilled};
pub use scheduler::SchedulerConfig;

use crate::kv::KvPool;
use crate::metrics::Metrics;
use crate::model::{Model, SamplingParams};

/// A cheap, cloneable handle to the engine thread.
#[derive(Clone)]
pub struct Engine {
    inbox: std::sync::mpsc::Sender<GenerateRequest>,
    limits: Limits,
    alive: Arc<AtomicBool>,
    pub model: Arc<Model>,
    pub pool: Arc<KvPool>,
    pub metrics: Metrics,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("limits", &self.limits).finish()
    }
}

impl Engine {
    /// Starts the scheduler thread. `window` is the declared context window.
    pub fn start(model: Arc<Model>, pool: Arc<KvPool>, window: usize, metrics: Metrics, config: SchedulerConfig) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        let alive = Arc::new(AtomicBool::new(true));
        let gauges = crate::metrics::PoolGauges::new(&metrics.registry, &metrics.role);
        gauges.capacity_tokens.set(pool.capacity_tokens() as i64);
        gauges.pages.set(pool.num_pages() as i64);
        metrics.context_window_tokens.set(window as i64);
        pool.report_usage_to(gauges.usage());
        let scheduler = scheduler::Scheduler::new(model.clone(), pool.clone(), metrics.clone(), config);
        let flag = alive.clone();
        std::thread::Builder::new()
            .name("kvgate-engine".into())
            .spawn(move || {
                // Clears the flag however the loop ends, panics included.
                struct Alive(Arc<AtomicBool>);
                impl Drop for Alive {
                    fn drop(&mut self) {
                        self.0.store(false, Ordering::SeqCst);
                    }
                }
                let _alive = Alive(flag);
                let _compute = crate::cpu::threads::join_compute_pool();
                scheduler.run(rx);
            })
            .expect("spawn engine thread");
        Engine { inbox: tx, limits: Limits { window, pool_tokens: pool.capacity_tokens() }, alive, model, pool, metrics }
    }

    pub fn tokenizer(&self) -> Arc<crate::tokenizer::Tokenizer> {
        self.model.tokenizer.clone()
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// False once the engine thread has stopped (it only stops on a bug).
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Admits and queues a request. Rejections happen here, before any page is reserved.
    pub fn submit(&self, prompt: Vec<u32>, max_tokens: usize, sampling: SamplingParams, tenant: &str) -> Result<mpsc::UnboundedReceiver<Event>, Rejection> {
        admission::admit(self.limits, prompt.len(), max_tokens)?;
        Ok(self.enqueue(prompt, max_tokens, sampling, Mode::Full, tenant))
    }

    /// Queues a request whose admission was decided elsewhere (prefill-only work, or a
    /// continuation over pages that arrived by handoff).
    /// `tenant` is whose work it is (the scheduler shares compute between tenants).
    pub fn enqueue(&self, prompt: Vec<u32>, max_tokens: usize, sampling: SamplingParams, mode: Mode, tenant: &str) -> mpsc::UnboundedReceiver<Event> {
        let (events, rx) = mpsc::unbounded_channel();
        let span = tracing::Span::current();
        let req = GenerateRequest { prompt, max_tokens, sampling, arrived: Instant::now(), events, mode, span, tenant: tenant.into() };
        if let Err(std::sync::mpsc::SendError(req)) = self.inbox.send(req) {
            // Only reachable if the engine thread died; surface it as a failed request.
            let _ = req.events.send(Event::Failed(Failure::internal("engine is not running")));
        }
        rx
    }
}

#[cfg(test)]
mod tests;
