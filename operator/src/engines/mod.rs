//! The engines users already run, behind the same gate: where each says how many tokens one
//! request may use, and how to ask it a greedy question for the canary. One small module per
//! engine; the parsers are pure, with table tests over bodies recorded from the real servers
//! (`testdata/`; SGLang's is built from its source, since it cannot run on these machines).
//!
//! An engine's answer is not signed (the operator believes the pod's HTTP answer). What an
//! engine counts of KV that moved wrong (`integrity.rs`) judges its canary and its bake as
//! kvgate's own mismatch counters judge kvgate's.

pub mod integrity;
pub mod kvgate;
pub mod llamacpp;
pub mod sglang;
pub mod vllm;

use std::time::Duration;

use futures::future::BoxFuture;

use crate::capacity::NoReport;
use crate::crd::{Engine, InferenceDeploymentSpec};
use crate::role::Role;

/// An engine as the operator's core sees it: which roles a deployment runs, where its pods
/// serve, how to read one pod's capacity and ask it a greedy question, and whether kvgate's
/// handoff integrity (a handoff Secret, signed capacity reports, mismatch counters a bake
/// judges) comes with it. kvgate's workers and each external engine implement it; nothing
/// outside this module matches on [`Engine`].
pub trait EngineKind: Sync {
    fn engine(&self) -> Engine;

    /// The port its pods serve HTTP on unless the spec says otherwise.
    fn default_port(&self) -> u16;

    /// The health endpoint its pods' readiness probes ask by default.
    fn health_path(&self) -> &'static str {
        "/health"
    }

    /// The roles rendered for every revision of `spec`. External engines: one server, or
    /// prefill, decode and their router when the spec disaggregates them.
    fn roles(&self, spec: &InferenceDeploymentSpec) -> &'static [Role] {
        if spec.prefill.is_some() { &[Role::Prefill, Role::Decode, Role::Router] } else { &[Role::Server] }
    }

    /// The role whose pods serve the deployment's API (its Service, its InferencePool, the
    /// canary's questions).
    fn api_role(&self, spec: &InferenceDeploymentSpec) -> Role {
        if spec.prefill.is_some() { Role::Router } else { Role::Server }
    }

    /// kvgate's handoff integrity: a handoff Secret, capacity reports signed with it, the
    /// shared router, and handoff mismatch counters a bake judges.
    fn integrity(&self) -> bool {
        false
    }

    /// The counters on its KV pods' `/metrics` whose increase means KV moved wrong. Any growth
    /// during the canary refuses a revision; growth past `maxHandoffMismatches` during the bake
    /// rolls it back. None: its KV moves inside one server, and its promotions do not bake.
    fn integrity_counters(&self, _: &InferenceDeploymentSpec) -> &'static [integrity::Counter] {
        &[]
    }

    /// Whether `role`'s pods run kvgate's verifying KV connector inside the engine (every block
    /// they move checked against the deployment's handoff secret): vLLM's prefill and decode.
    fn verifies_handoff(&self, _: &InferenceDeploymentSpec, _: Role) -> bool {
        false
    }

    /// Whether its servers pass tensors in shared memory (a `/dev/shm` beyond 64 MiB).
    fn shared_memory(&self) -> bool {
        false
    }

    /// What one pod says one request may use (external engines; kvgate's workers report
    /// through their signed capacity report instead).
    fn read<'a>(&'a self, http: &'a reqwest::Client, base: String) -> BoxFuture<'a, Result<EngineCapacity, NoReport>>;

    /// The request for a greedy completion (token ids in and out): its path and body.
    fn greedy(&self, model: &str, q: &Greedy<'_>) -> Option<(&'static str, serde_json::Value)>;

    /// The generated token ids in an answer to [`EngineKind::greedy`].
    fn tokens(&self, body: &str) -> Result<Vec<u32>, String>;
}

/// Every engine, found by the name its spec gives.
static ENGINES: [&dyn EngineKind; 4] = [&kvgate::Kvgate, &llamacpp::Llamacpp, &vllm::Vllm, &sglang::Sglang];

/// kvgate's own workers: the engine of every prefill x decode pair.
pub fn own() -> &'static dyn EngineKind {
    &kvgate::Kvgate
}

/// The engine `engine` names.
pub fn of(engine: Engine) -> &'static dyn EngineKind {
    *ENGINES.iter().find(|e| e.engine() == engine).expect("every Engine has an EngineKind")
}

impl InferenceDeploymentSpec {
    /// The engine behind this spec.
    pub fn engine(&self) -> &'static dyn EngineKind {
        of(self.engine)
    }

    /// Whether the deployment has a handoff Secret: kvgate's workers always, an engine's roles
    /// when they verify their KV handoffs.
    pub fn handoff_secret(&self) -> bool {
        self.engine().integrity() || self.engine_verifies_handoffs()
    }

    /// Whether any role runs kvgate's verifying connector inside the engine.
    pub fn engine_verifies_handoffs(&self) -> bool {
        [Role::Prefill, Role::Decode].into_iter().any(|role| self.engine().verifies_handoff(self, role))
    }

    /// The roles rendered for every revision (the gate verifies every pod of them).
    pub fn roles(&self) -> &'static [Role] {
        self.engine().roles(self)
    }

    /// The HTTP port of `role`'s pods: the worker's, or the engine's.
    pub fn port(&self, role: Role) -> u16 {
        match self.external(role) {
            Some(e) => e.port.unwrap_or_else(|| self.engine().default_port()),
            None => match role.worker() {
                Some(worker) => worker.port(),
                None => self.engine().default_port(),
            },
        }
    }
}

/// What an engine says one request may use, and where it says it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineCapacity {
    pub engine: Engine,
    /// Tokens one request may use (prompt + completion): the smallest limit the engine enforces.
    pub tokens: u64,
    /// The engine's own name for that limit, e.g. `n_ctx per slot` or `max_model_len`.
    pub field: String,
    /// What the engine serves (its model path or id): two pods with the same one must agree
    /// token for token.
    pub model: String,
    /// The rest of what it said that explains the number (slots, blocks, ...).
    pub detail: String,
}

/// How long one read or one canary completion may take.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
const GENERATE_TIMEOUT: Duration = Duration::from_secs(120);

async fn get_text(http: &reqwest::Client, url: &str) -> Result<String, NoReport> {
    let resp = http.get(url).timeout(READ_TIMEOUT).send().await.map_err(|e| NoReport::waiting(format!("GET {url}: {}", crate::capacity::cause(&e))))?;
    if !resp.status().is_success() {
        return Err(NoReport::waiting(format!("GET {url}: HTTP {}", resp.status())));
    }
    resp.text().await.map_err(|e| NoReport::waiting(format!("GET {url}: {}", crate::capacity::cause(&e))))
}

/// An answer the adapter cannot read: `CapacityUnreadable`, naming the endpoint and what is
/// missing.
fn unreadable(url: String, why: String) -> NoReport {
    NoReport { reason: crate::capacity::NoReportReason::Unreadable, message: format!("GET {url}: {why}") }
}

/// A capacity read from one endpoint's body (`GET {base}{path}`), by the engine's parser.
async fn read_one(http: &reqwest::Client, base: &str, path: &str, parse: fn(&str) -> Result<EngineCapacity, String>) -> Result<EngineCapacity, NoReport> {
    let url = format!("{base}{path}");
    let body = get_text(http, &url).await?;
    parse(&body).map_err(|why| unreadable(url, why))
}

/// Reads an external engine pod's capacity: unreachable is `AwaitingCapacityReport`, an answer
/// the adapter cannot read is `CapacityUnreadable` naming the endpoint and what is missing.
pub async fn read(http: &reqwest::Client, engine: Engine, ip: &str, port: u16) -> Result<EngineCapacity, NoReport> {
    of(engine).read(http, format!("http://{ip}:{port}")).await
}

/// A greedy question: token ids in, at most `max_tokens` ids out (exactly that many with
/// `ignore_eos`, unless the engine stops at its window).
#[derive(Debug, Clone, Copy)]
pub struct Greedy<'a> {
    pub prompt: &'a [u32],
    pub max_tokens: u32,
    pub ignore_eos: bool,
}

/// Why a question got no tokens: the HTTP status when the engine answered one (a refusal), and
/// what it said or what failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoAnswer {
    pub status: Option<u16>,
    pub message: String,
}

impl NoAnswer {
    pub fn failed(message: impl Into<String>) -> Self {
        NoAnswer { status: None, message: message.into() }
    }

    /// A 4xx: the engine turned the request away as the client's fault.
    pub fn refused(&self) -> bool {
        self.status.is_some_and(|s| (400..500).contains(&s))
    }
}

impl std::fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// The tokens an engine pod generates greedily for `q`, through its own API.
pub async fn generate(http: &reqwest::Client, engine: Engine, ip: &str, port: u16, model: &str, q: &Greedy<'_>) -> Result<Vec<u32>, NoAnswer> {
    let kind = of(engine);
    let (path, body) = kind.greedy(model, q).ok_or_else(|| NoAnswer::failed("kvgate's canary drives prefill x decode pairs"))?;
    let url = format!("http://{ip}:{port}{path}");
    let failed = |e: reqwest::Error| NoAnswer::failed(format!("POST {url}: {}", crate::capacity::cause(&e)));
    let resp = http.post(&url).timeout(GENERATE_TIMEOUT).json(&body).send().await.map_err(failed)?;
    let status = resp.status();
    let text = resp.text().await.map_err(failed)?;
    if !status.is_success() {
        return Err(NoAnswer { status: Some(status.as_u16()), message: format!("POST {url}: HTTP {}: {}", status.as_u16(), text.trim()) });
    }
    kind.tokens(&text).map_err(|why| NoAnswer::failed(format!("POST {url}: {why}")))
}

/// A JSON body, or why it is not one.
fn json(body: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(body).map_err(|e| format!("not JSON: {e}"))
}

/// A non-negative integer field, or why it is missing.
fn count(v: &serde_json::Value, pointer: &str) -> Result<u64, String> {
    v.pointer(pointer).and_then(serde_json::Value::as_u64).ok_or_else(|| format!("no non-negative integer at {pointer}"))
}

/// Token ids from a JSON array.
fn ids(v: Option<&serde_json::Value>, what: &str) -> Result<Vec<u32>, String> {
    let list = v.and_then(serde_json::Value::as_array).ok_or_else(|| format!("no {what} in the answer"))?;
    list.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| format!("{what}: {t} is not a token id"))).collect()
}
