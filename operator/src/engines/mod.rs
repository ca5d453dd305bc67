//! The engines users already run, behind the same gate: where each says how many tokens one
//! request may use, and how to ask it a greedy question for the canary. One small module per
//! engine; the parsers are pure, with table tests over bodies recorded from the real servers
//! (`testdata/`; SGLang's is built from its source, since it cannot run on these machines).
//!
//! An engine's answer is not signed (the operator believes the pod's HTTP answer); handoff
//! integrity is a property of kvgate's own workers only.

pub mod llamacpp;
pub mod sglang;
pub mod vllm;

use std::time::Duration;

use crate::capacity::NoReport;
use crate::crd::Engine;

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

/// Why an engine's answer could not be used: the gate condition's reason when a pod answers
/// but not with something its engine's adapter can read.
pub const UNREADABLE: &str = "CapacityUnreadable";

/// The port an engine serves HTTP on by default.
pub fn default_port(engine: Engine) -> u16 {
    match engine {
        Engine::Kvgate => kvgate_proto::contract::ROUTER_PORT,
        Engine::Llamacpp => 8080,
        Engine::Vllm => 8000,
        Engine::Sglang => 30000,
    }
}

/// The engine's health endpoint (its probes' default).
pub fn health_path(engine: Engine) -> &'static str {
    match engine {
        Engine::Kvgate => "/healthz",
        _ => "/health",
    }
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

/// Reads an external engine pod's capacity: unreachable is `AwaitingCapacityReport`, an answer
/// the adapter cannot read is `CapacityUnreadable` naming the endpoint and what is missing.
pub async fn read(http: &reqwest::Client, engine: Engine, ip: &str, port: u16) -> Result<EngineCapacity, NoReport> {
    let base = format!("http://{ip}:{port}");
    let unreadable = |url: String, why: String| NoReport { reason: UNREADABLE, message: format!("GET {url}: {why}") };
    match engine {
        Engine::Llamacpp => {
            let url = format!("{base}{}", llamacpp::PROPS);
            let body = get_text(http, &url).await?;
            llamacpp::capacity(&body).map_err(|why| unreadable(url, why))
        }
        Engine::Vllm => {
            let (metrics, models) = (format!("{base}{}", vllm::METRICS), format!("{base}{}", vllm::MODELS));
            let (m, v) = (get_text(http, &metrics).await?, get_text(http, &models).await?);
            vllm::capacity(&m, &v).map_err(|why| unreadable(format!("{metrics} and {models}"), why))
        }
        Engine::Sglang => {
            let url = format!("{base}{}", sglang::SERVER_INFO);
            let body = get_text(http, &url).await?;
            sglang::capacity(&body).map_err(|why| unreadable(url, why))
        }
        Engine::Kvgate => Err(NoReport::waiting("a kvgate worker reports through its signed capacity report")),
    }
}

/// The tokens an engine pod generates greedily for `prompt` (token ids), through its own API.
pub async fn generate(http: &reqwest::Client, engine: Engine, ip: &str, port: u16, model: &str, prompt: &[u32], max_tokens: u32) -> Result<Vec<u32>, String> {
    let (path, body) = match engine {
        Engine::Llamacpp => (llamacpp::COMPLETION, llamacpp::greedy(prompt, max_tokens)),
        Engine::Vllm => (vllm::COMPLETIONS, vllm::greedy(model, prompt, max_tokens)),
        Engine::Sglang => (sglang::GENERATE, sglang::greedy(prompt, max_tokens)),
        Engine::Kvgate => return Err("kvgate's canary drives prefill x decode pairs".into()),
    };
    let url = format!("http://{ip}:{port}{path}");
    let resp = http.post(&url).timeout(GENERATE_TIMEOUT).json(&body).send().await.map_err(|e| format!("POST {url}: {}", crate::capacity::cause(&e)))?;
    let status = resp.status();
    let text = resp.text().await.map_err(|e| format!("POST {url}: {}", crate::capacity::cause(&e)))?;
    if !status.is_success() {
        return Err(format!("POST {url}: HTTP {}: {}", status.as_u16(), text.trim()));
    }
    let tokens = match engine {
        Engine::Llamacpp => llamacpp::tokens(&text),
        Engine::Vllm => vllm::tokens(&text),
        _ => sglang::tokens(&text),
    };
    tokens.map_err(|why| format!("POST {url}: {why}"))
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
