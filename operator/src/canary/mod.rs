//! The integrity canary: before a candidate revision's pods take traffic, the operator drives
//! fixed greedy prompts through them itself. For kvgate's workers, through every candidate
//! prefill x decode pair over the path the router uses (`pair.rs`): checksums prove a transfer
//! arrived as sent; only comparing outputs proves that prefill computed the right KV and that
//! decode read it where it landed. For an external engine, through every server pod's own API
//! (`engines::generate`).
//!
//! The revision passes only if every pair (or pod) answers, all give the same tokens for each
//! prompt, those equal what the serving revision gives when it serves the same model (and, for
//! kvgate, the same KV layout), and no integrity counter of a candidate KV pod moved (kvgate's
//! `kvgate_handoff_mismatch_total`; a disaggregated engine's own, `engines::integrity`).

mod pair;
pub mod prompts;

pub use pair::Endpoint;

use kvgate_proto::auth::DeploymentKey;

use crate::crd::{CanaryStatus, Engine};
use crate::engines::integrity::{self, Counter, Counts};
use crate::engines::{Greedy, NoAnswer};
use crate::rollout_state::RefusalReason;
use crate::{engines, scrape};

/// One canary run, as decided from what a reconcile observed (pure data).
#[derive(Debug, Clone, PartialEq)]
pub struct CanaryRun {
    pub revision: String,
    pub target: Target,
    /// A serving revision serving the same model (and layout), and the window it was verified
    /// for (longer prompts are compared among the candidate's pods only).
    pub reference: Option<Reference>,
    pub prompts: u32,
    pub page_size: u32,
    pub max_prompt_tokens: u64,
    pub vocab: u32,
    pub max_tokens: u32,
    /// The boundary probes, when `spec.rollout.boundaryProbe.canary` asks for them.
    pub boundary: Option<Boundary>,
    /// The stale-KV probe: this many filler prompts before the compared prompts are asked again.
    pub stale_kv: Option<u32>,
    /// The candidate's KV pods whose `counters` must not move while the canary runs.
    pub counted: Vec<Counted>,
    pub counters: &'static [Counter],
}

/// A KV pod whose integrity counters the canary reads before and after (`/metrics` on `port`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counted {
    pub pod: String,
    pub role: crate::role::Role,
    pub ip: String,
    pub port: u16,
}

/// The request that broke production, asked of every pair or pod before any traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Boundary {
    /// The declared window: a prompt of one token more must be refused with a 4xx.
    pub window: u64,
    /// The window is within the probes' budget: a prompt of the whole window (less the answer)
    /// must be served, and one of `window - 1` tokens asking for more must be refused or stop
    /// at the window.
    pub full: bool,
}

/// What a canary drives.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// kvgate: every prefill x decode pair.
    Pairs { prefill: Vec<Endpoint>, decode: Vec<Endpoint> },
    /// An external engine: every server pod (or a disaggregated revision's routers), through
    /// its own API.
    Servers { engine: Engine, role: crate::role::Role, port: u16, model: String, pods: Vec<Endpoint> },
}

/// A serving revision the candidate's outputs must equal (one pair, or one pod).
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    pub revision: String,
    pub target: Target,
    pub context_window: u64,
}

/// One thing that generates: a prefill x decode pair or an engine pod.
enum Unit<'a> {
    Pair(&'a Endpoint, &'a Endpoint),
    Server { engine: Engine, port: u16, model: &'a str, pod: &'a Endpoint },
}

impl Target {
    fn units(&self) -> Vec<Unit<'_>> {
        match self {
            Target::Pairs { prefill, decode } => prefill.iter().flat_map(|p| decode.iter().map(move |d| Unit::Pair(p, d))).collect(),
            Target::Servers { engine, port, model, pods, .. } => pods.iter().map(|pod| Unit::Server { engine: *engine, port: *port, model, pod }).collect(),
        }
    }

    /// What a probe that catches one of its units counts: the engine, and the role the
    /// question went to (`pair` for kvgate's prefill x decode pairs).
    fn mismatch(&self, probe: Probe) -> ProbeMismatch {
        match self {
            Target::Pairs { .. } => ProbeMismatch { probe, engine: engines::own().engine(), role: "pair" },
            Target::Servers { engine, role, .. } => ProbeMismatch { probe, engine: *engine, role: role.as_str() },
        }
    }

    /// The engine its units run.
    fn engine(&self) -> Engine {
        match self {
            Target::Pairs { .. } => engines::own().engine(),
            Target::Servers { engine, .. } => *engine,
        }
    }

    /// Pairs or pods its questions go to.
    pub fn unit_count(&self) -> usize {
        match self {
            Target::Pairs { prefill, decode } => prefill.len() * decode.len(),
            Target::Servers { pods, .. } => pods.len(),
        }
    }

    fn describe(&self) -> String {
        match self {
            Target::Pairs { prefill, decode } => format!("{} pairs", prefill.len() * decode.len()),
            Target::Servers { engine, pods, .. } => format!("{} {} pods", pods.len(), engine.as_str()),
        }
    }
}

impl Unit<'_> {
    /// The pods a question to this unit went through.
    fn pods(&self) -> Vec<String> {
        match self {
            Unit::Pair(p, d) => vec![p.pod.clone(), d.pod.clone()],
            Unit::Server { pod, .. } => vec![pod.pod.clone()],
        }
    }

    fn name(&self) -> String {
        match self {
            Unit::Pair(p, d) => format!("pair prefill {} x decode {}", p.pod, d.pod),
            Unit::Server { engine, pod, .. } => format!("{} pod {}", engine.as_str(), pod.pod),
        }
    }

    async fn generate(&self, http: &reqwest::Client, key: Option<&DeploymentKey>, q: &Greedy<'_>) -> Result<Vec<u32>, NoAnswer> {
        match self {
            Unit::Pair(p, d) => pair::generate(http, key.ok_or_else(|| NoAnswer::failed("no handoff key to sign the canary's calls"))?, p, d, q).await,
            Unit::Server { engine, port, model, pod } => engines::generate(http, *engine, &pod.ip, *port, model, q).await,
        }
    }

    /// A greedy question as the canary asks it.
    async fn ask(&self, http: &reqwest::Client, key: Option<&DeploymentKey>, prompt: &[u32], max_tokens: u32) -> Result<Vec<u32>, NoAnswer> {
        self.generate(http, key, &Greedy { prompt, max_tokens, ignore_eos: false }).await
    }

    /// Asks for one token after `over` (a prompt past the window): what an honest engine does
    /// with it is refuse it with a 4xx.
    async fn past_window(&self, http: &reqwest::Client, key: Option<&DeploymentKey>, over: &[u32]) -> PastWindow {
        match self.generate(http, key, &Greedy { prompt: over, max_tokens: 1, ignore_eos: true }).await {
            Ok(tokens) => PastWindow::Answered(tokens),
            Err(e) if e.refused() => PastWindow::Refused(e.status.unwrap_or_default()),
            Err(e) => PastWindow::Failed(e),
        }
    }
}

/// What a pair or pod did with a prompt past the window.
enum PastWindow {
    Refused(u16),
    Answered(Vec<u32>),
    Failed(NoAnswer),
}

/// The message of an answer past the window.
fn answered_past(name: &str, over: usize, window: u64, tokens: &[u32]) -> String {
    format!(
        "{name}: a prompt of {over} tokens (contextWindow {window} + 1) was answered with {} tokens {tokens:?} instead of a 4xx: the engine truncates, shifts or answers for a prompt it cannot hold",
        tokens.len()
    )
}

/// Which probe caught a pair or pod giving what it must not: `kvgate_operator_probe_mismatches_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr, strum::VariantArray)]
#[strum(serialize_all = "snake_case")]
pub enum Probe {
    /// An answer past the window (`BoundaryProbeAnswered`).
    Boundary,
    /// Other output for a prompt after other prompts filled the pool: pages read that other
    /// requests wrote.
    StaleKv,
}

/// A probe's catch: which probe, on what (engine and the role the question went to).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeMismatch {
    pub probe: Probe,
    pub engine: Engine,
    /// `pair` (a kvgate prefill x decode pair), `server` or `router`.
    pub role: &'static str,
}

/// Why a canary run failed: the refusal's reason, its message, and the probe that caught it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Failure {
    reason: RefusalReason,
    message: String,
    caught: Option<ProbeMismatch>,
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure { reason: RefusalReason::CanaryFailed, message, caught: None }
    }
}

/// Runs the canary (`key` signs kvgate's internal calls); the status to record for the revision,
/// and what a probe caught.
pub async fn run(http: &reqwest::Client, key: Option<&DeploymentKey>, run: &CanaryRun) -> (CanaryStatus, Option<ProbeMismatch>) {
    match check(http, key, run).await {
        Ok(message) => (CanaryStatus { revision: run.revision.clone(), passed: true, message, reason: None }, None),
        Err(f) => (CanaryStatus { revision: run.revision.clone(), passed: false, message: f.message, reason: Some(f.reason) }, f.caught),
    }
}

/// Where two outputs first differ.
fn first_difference(a: &[u32], b: &[u32]) -> Option<usize> {
    (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i))
}

fn token_at(tokens: &[u32], i: usize) -> String {
    tokens.get(i).map_or_else(|| "the end of its output".to_string(), |t| format!("token id {t}"))
}

async fn check(http: &reqwest::Client, key: Option<&DeploymentKey>, run: &CanaryRun) -> Result<String, Failure> {
    let before = counters(http, run).await?;
    // The counters are read after the questions whether or not they were answered: an engine
    // that refuses KV it could not verify fails the request (HTTP 500), and the counter that
    // moved, not the 500, is why.
    let asked = ask(http, key, run).await;
    let after = counters(http, run).await?;
    let grown: Vec<String> = run
        .counted
        .iter()
        .zip(before.iter().zip(&after))
        .filter_map(|(c, (was, now))| {
            let grown = integrity::grown(was, now);
            (!grown.is_empty()).then(|| format!("{} pod {} ({}): {}", run.target.engine().as_str(), c.pod, c.role.as_str(), grown.join(", ")))
        })
        .collect();
    if !grown.is_empty() {
        let failed = asked.as_ref().err().map(|f| format!("; {}", f.message)).unwrap_or_default();
        return Err(Failure {
            reason: RefusalReason::HandoffIntegrityViolation,
            message: format!("integrity counters moved during the canary: {}{failed}", grown.join("; ")),
            caught: None,
        });
    }
    let mismatch = if run.counted.is_empty() { "" } else { "; no integrity counter moved" };
    asked.map(|[compared, probes]| format!("{compared}{mismatch}{probes}"))
}

/// The canary's questions, the stale-KV and the boundary probes: what the compared prompts gave
/// and what the probes found, or the first that failed.
async fn ask(http: &reqwest::Client, key: Option<&DeploymentKey>, run: &CanaryRun) -> Result<[String; 2], Failure> {
    let mut prompts = prompts::prompts(run.prompts, run.page_size, run.max_prompt_tokens, run.vocab);
    if let Some(b) = run.boundary.filter(|b| b.full) {
        // The whole window, less the answer: served, and the same everywhere.
        prompts.push(prompts::of_len(b.window.saturating_sub(u64::from(run.max_tokens)).max(1), run.vocab, 0xb0));
    }
    // What each prompt must give: the serving revision's output, else the first unit's.
    let mut want: Vec<Option<(String, Vec<u32>)>> = vec![None; prompts.len()];
    if let Some(r) = &run.reference
        && let Some(unit) = r.target.units().first()
    {
        let by = format!("serving revision {} ({})", r.revision, unit.name());
        let fits = |p: &Vec<u32>| p.len() as u64 + u64::from(run.max_tokens) <= r.context_window;
        for (w, prompt) in want.iter_mut().zip(&prompts).filter(|(_, p)| fits(p)) {
            let tokens = unit.ask(http, key, prompt, run.max_tokens).await.map_err(|e| format!("{by}, prompt of {} tokens: {e}", prompt.len()))?;
            *w = Some((by.clone(), tokens));
        }
    }
    for unit in run.target.units() {
        let name = unit.name();
        for (w, prompt) in want.iter_mut().zip(&prompts) {
            let n = prompt.len();
            let got = unit.ask(http, key, prompt, run.max_tokens).await.map_err(|e| format!("{name}, prompt of {n} tokens: {e}"))?;
            match w {
                None => *w = Some((name.clone(), got)),
                Some((by, expected)) => {
                    if let Some(i) = first_difference(expected, &got) {
                        return Err(Failure::from(format!(
                            "{name}, prompt of {n} tokens: output token {i} is {}, but {by} gave {}",
                            token_at(&got, i),
                            token_at(expected, i)
                        )));
                    }
                }
            }
        }
    }
    let stale = match run.stale_kv {
        Some(fillers) => stale_kv(http, key, run, &prompts, &want, fillers).await?,
        None => String::new(),
    };
    let probed = match run.boundary {
        Some(b) => boundary(http, key, run, b).await?,
        None => String::new(),
    };
    let lengths: Vec<String> = prompts.iter().map(|p| p.len().to_string()).collect();
    let compared = match &run.reference {
        Some(r) => format!(", equal to serving revision {}'s where they fit its window of {}", r.revision, r.context_window),
        None => String::new(),
    };
    let summary = format!(
        "{} prompts ({} tokens) x {} generated tokens through {}: all gave the same tokens{compared}",
        prompts.len(),
        lengths.join(", "),
        run.max_tokens,
        run.target.describe()
    );
    Ok([summary, format!("{stale}{probed}")])
}

/// The stale-KV probe on every unit: `fillers` other prompts of the longest length fill its pool
/// (as a tenant's traffic would), then every compared prompt must give the tokens it gave before.
/// An engine that reads pages other requests wrote (the incident's decode) answers otherwise.
async fn stale_kv(
    http: &reqwest::Client,
    key: Option<&DeploymentKey>,
    run: &CanaryRun,
    prompts: &[Vec<u32>],
    want: &[Option<(String, Vec<u32>)>],
    fillers: u32,
) -> Result<String, Failure> {
    for unit in run.target.units() {
        let name = unit.name();
        for f in 0..fillers {
            let filler = prompts::of_len(run.max_prompt_tokens, run.vocab, 0xf00 + u64::from(f));
            unit.ask(http, key, &filler, 1).await.map_err(|e| format!("{name}, filler prompt {f} of {} tokens: {e}", filler.len()))?;
        }
        for (w, prompt) in want.iter().zip(prompts) {
            let Some((by, expected)) = w else { continue };
            let n = prompt.len();
            let got = unit.ask(http, key, prompt, run.max_tokens).await.map_err(|e| format!("{name}, prompt of {n} tokens after the fillers: {e}"))?;
            if let Some(i) = first_difference(expected, &got) {
                return Err(Failure {
                    reason: RefusalReason::CanaryFailed,
                    message: format!(
                        "stale KV: {name}, prompt of {n} tokens after {fillers} other prompts of {} tokens: output token {i} is {}, but {by} gave {}",
                        run.max_prompt_tokens,
                        token_at(&got, i),
                        token_at(expected, i)
                    ),
                    caught: Some(run.target.mismatch(Probe::StaleKv)),
                });
            }
        }
    }
    Ok(format!("; the same again after {fillers} other prompts of {} tokens on each", run.max_prompt_tokens))
}

/// The boundary probes on every unit: a prompt of `window + 1` tokens must be refused with a
/// 4xx; within the budget, one of `window - 1` tokens asking for more (ignoring EOS) must be
/// refused or stop at the window. An answer past the window is `BoundaryProbeAnswered`.
async fn boundary(http: &reqwest::Client, key: Option<&DeploymentKey>, run: &CanaryRun, b: Boundary) -> Result<String, Failure> {
    let past = |message: String| Failure { reason: RefusalReason::BoundaryProbeAnswered, message, caught: Some(run.target.mismatch(Probe::Boundary)) };
    let over = prompts::of_len(b.window + 1, run.vocab, 0xb1);
    let under = prompts::of_len(b.window.saturating_sub(1).max(1), run.vocab, 0xb2);
    let more = run.max_tokens.max(2);
    let mut refusals = Vec::new();
    for unit in run.target.units() {
        let name = unit.name();
        match unit.past_window(http, key, &over).await {
            PastWindow::Refused(status) => refusals.push(status),
            PastWindow::Answered(tokens) => return Err(past(answered_past(&name, over.len(), b.window, &tokens))),
            PastWindow::Failed(e) => {
                return Err(Failure::from(format!("{name}: a prompt of {} tokens (contextWindow + 1) must be refused with a 4xx: {e}", over.len())));
            }
        }
        if !b.full {
            continue;
        }
        match unit.generate(http, key, &Greedy { prompt: &under, max_tokens: more, ignore_eos: true }).await {
            Err(e) if e.refused() => {}
            Ok(tokens) if tokens.len() <= 1 => {}
            Ok(tokens) => {
                return Err(past(format!(
                    "{name}: a prompt of {} tokens asking for {more} more was answered with {} tokens, {} past contextWindow {}: the engine shifts or drops context instead of stopping at the window",
                    under.len(),
                    tokens.len(),
                    tokens.len() - 1,
                    b.window
                )));
            }
            Err(e) => return Err(Failure::from(format!("{name}: a prompt of {} tokens asking for {more} more: {e}", under.len()))),
        }
    }
    refusals.sort_unstable();
    refusals.dedup();
    let statuses: Vec<String> = refusals.iter().map(u16::to_string).collect();
    let stop = if b.full { format!(", one of {} tokens was refused or stopped at the window", under.len()) } else { String::new() };
    Ok(format!("; boundary: a prompt of contextWindow + 1 tokens was refused (HTTP {}) by every one{stop}", statuses.join("/")))
}

/// The probes on a serving revision, at a rate, beside its live traffic (`tasks::serving_probes`).
#[derive(Debug, Clone, PartialEq)]
pub struct ServingRun {
    pub revision: String,
    pub target: Target,
    /// The declared window: a prompt of one token more must be refused with a 4xx.
    pub window: u64,
    /// Asked of every unit each round; its answer must stay what the unit first gave for it,
    /// whatever live traffic wrote into the pool in between (stale KV).
    pub reference: Vec<u32>,
    pub max_tokens: u32,
    /// Token ids the probes' prompts draw from (below every vocabulary they meet).
    pub vocab: u32,
    /// Seconds between rounds, and prompt tokens the rounds may have engines compute per hour.
    pub every_seconds: u64,
    pub max_tokens_per_hour: u64,
}

/// What a unit failed in a serving round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caught {
    /// The pods the question went through (a kvgate pair names both).
    pub pods: Vec<String>,
    pub reason: RefusalReason,
    pub message: String,
    pub mismatch: ProbeMismatch,
}

/// One serving round: each unit's answer to the reference prompt, what it failed, and the prompt
/// tokens engines computed for it.
#[derive(Debug, Clone, Default)]
pub struct Round {
    pub answers: std::collections::HashMap<String, Vec<u32>>,
    pub caught: Vec<Caught>,
    pub computed_tokens: u64,
}

/// Asks every unit of a serving revision: a prompt of `window + 1` tokens must be refused with
/// a 4xx, and the reference prompt must give what the unit gave the first time (`before`, by
/// unit name). A unit that does not answer at all is left to the capacity probes.
pub async fn serving_round(
    http: &reqwest::Client,
    key: Option<&DeploymentKey>,
    run: &ServingRun,
    before: &std::collections::HashMap<String, Vec<u32>>,
) -> Round {
    let over = prompts::of_len(run.window + 1, run.vocab, 0xb1);
    let mut round = Round::default();
    for unit in run.target.units() {
        let name = unit.name();
        let catch = |reason, probe, message: String| Caught { pods: unit.pods(), reason, message, mismatch: run.target.mismatch(probe) };
        match unit.past_window(http, key, &over).await {
            PastWindow::Refused(_) => {}
            PastWindow::Answered(tokens) => {
                round.computed_tokens += over.len() as u64;
                round.caught.push(catch(RefusalReason::BoundaryProbeAnswered, Probe::Boundary, answered_past(&name, over.len(), run.window, &tokens)));
                continue;
            }
            PastWindow::Failed(_) => continue,
        }
        let Ok(got) = unit.ask(http, key, &run.reference, run.max_tokens).await else { continue };
        round.computed_tokens += run.reference.len() as u64;
        if let Some(expected) = before.get(&name)
            && let Some(i) = first_difference(expected, &got)
        {
            round.caught.push(catch(
                RefusalReason::CanaryFailed,
                Probe::StaleKv,
                format!(
                    "stale KV: {name}, the reference prompt of {} tokens beside live traffic: output token {i} is {}, but it gave {} before",
                    run.reference.len(),
                    token_at(&got, i),
                    token_at(expected, i)
                ),
            ));
        }
        round.answers.insert(name, got);
    }
    round
}

/// Each counted pod's integrity counters, in `run.counted`'s order.
async fn counters(http: &reqwest::Client, run: &CanaryRun) -> Result<Vec<Counts>, Failure> {
    let mut out = Vec::new();
    for c in &run.counted {
        let text = scrape::metrics(http, &c.ip, c.port).await.map_err(|why| Failure::from(format!("{why} (pod {})", c.pod)))?;
        out.push(integrity::read(&text, run.counters));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_differ_where_a_token_or_the_length_differs() {
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_difference(&[1, 2, 3], &[1, 5, 3]), Some(1));
        assert_eq!(first_difference(&[1, 2], &[1, 2, 3]), Some(2));
        assert_eq!(token_at(&[1, 2], 2), "the end of its output");
    }

    #[test]
    fn pairs_are_every_prefill_with_every_decode_and_servers_every_pod() {
        let e = |n: &str| Endpoint { pod: n.into(), ip: "10.0.0.1".into(), instance: None };
        let pairs = Target::Pairs { prefill: vec![e("p0"), e("p1")], decode: vec![e("d0"), e("d1"), e("d2")] };
        assert_eq!(pairs.units().len(), 6);
        assert_eq!(pairs.units()[0].name(), "pair prefill p0 x decode d0");
        let servers =
            Target::Servers { engine: Engine::Llamacpp, role: crate::role::Role::Server, port: 8080, model: "m".into(), pods: vec![e("s0"), e("s1")] };
        assert_eq!(servers.units().iter().map(Unit::name).collect::<Vec<_>>(), ["llamacpp pod s0", "llamacpp pod s1"]);
    }
}
