//! `kubectl kvgate check`: would an engine you already run pass kvgate's gate? Asked of its URL (a
//! server on this machine, or a pod through `kubectl port-forward`) exactly as the operator asks
//! a pod: what one request may use, through the engine's own adapter (a pool below the window is
//! refused with the engine's numbers); then the integrity canary through the engine's own API,
//! with the boundary probes (the window served, the window + 1 refused with a 4xx) and the
//! stale-KV probe.

use crate::canary::prompts::ENGINE_VOCAB;
use crate::canary::{self, Boundary, CanaryRun, Endpoint, Target};
use crate::crd::Engine;
use crate::engines;
use crate::role::Role;
use crate::rollout_state::RefusalReason;

/// What to check, and how hard.
#[derive(Debug, Clone)]
pub struct Options {
    pub engine: Engine,
    /// `http://HOST:PORT` of one server.
    pub url: String,
    /// The context window it is to serve.
    pub window: u64,
    pub prompts: u32,
    pub max_tokens: u32,
    pub max_prompt_tokens: u64,
    /// Prompts that fill its pool before the compared prompts are asked again (0: no stale-KV
    /// probe).
    pub stale_kv_fillers: u32,
    /// Prompts of the whole window are asked only up to this window (as the operator's
    /// `boundaryProbe.maxPromptTokens`).
    pub max_probe_tokens: u64,
}

/// The verdict, with the engine's own numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Passed(String),
    Refused { reason: RefusalReason, message: String },
}

/// Checks the server at `o.url`; an error when it cannot be checked at all (no answer, an
/// answer the adapter cannot read, a URL that is not one).
pub async fn check(http: &reqwest::Client, o: &Options) -> Result<Verdict, String> {
    let url = reqwest::Url::parse(&o.url).map_err(|e| format!("{}: {e}", o.url))?;
    let (host, port) = (url.host_str().ok_or_else(|| format!("{}: no host", o.url))?.to_string(), url.port_or_known_default().unwrap_or(80));
    let base = format!("{}://{host}:{port}", url.scheme());
    // kvgate's own workers sign their reports for the operator; check holds no secret and reads
    // them unsigned, saying so.
    let (capacity, vocab) = if o.engine == engines::own().engine() {
        engines::kvgate::unsigned_capacity(http, &base).await.map(|(c, vocab)| (c, vocab.map_or(ENGINE_VOCAB, |v| v.min(ENGINE_VOCAB))))
    } else {
        engines::of(o.engine).read(http, base.clone()).await.map(|c| (c, ENGINE_VOCAB))
    }
    .map_err(|e| e.message)?;
    let measured = format!("{} server {base}: {} {}", o.engine.as_str(), capacity.field, capacity.tokens);
    if capacity.tokens < o.window {
        let message = format!("{measured} < contextWindow {} ({})", o.window, capacity.detail);
        return Ok(Verdict::Refused { reason: RefusalReason::KVPoolBelowContextWindow, message });
    }
    let max_tokens = o.max_tokens.min(o.window.saturating_sub(1).max(1) as u32);
    let run = CanaryRun {
        revision: "check".into(),
        target: Target::Servers {
            engine: o.engine,
            role: Role::Server,
            port,
            model: capacity.model.clone(),
            pods: vec![Endpoint { pod: base.clone(), ip: host, instance: None }],
        },
        reference: None,
        prompts: o.prompts,
        page_size: 16,
        max_prompt_tokens: o.max_prompt_tokens.min(o.window - u64::from(max_tokens)).max(1),
        vocab,
        max_tokens,
        boundary: Some(Boundary { window: o.window, full: o.window <= o.max_probe_tokens }),
        stale_kv: (o.stale_kv_fillers > 0).then_some(o.stale_kv_fillers),
        counted: Vec::new(),
        counters: &[],
    };
    let (status, _) = canary::run(http, None, &run).await;
    Ok(if status.passed {
        Verdict::Passed(format!("{measured} >= contextWindow {} ({}); canary: {}", o.window, capacity.detail, status.message))
    } else {
        Verdict::Refused { reason: status.reason.unwrap_or(RefusalReason::CanaryFailed), message: status.message }
    })
}
