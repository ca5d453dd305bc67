//! kvgate's own router, prefill and decode workers: handoff integrity end to end. Their
//! capacity comes from signed reports (`capacity.rs`), their canary drives prefill x decode pairs
//! (`canary/pair.rs`), and their mismatch counters judge a bake. `kubectl kvgate check` asks a
//! router (or one worker) what it measured, unsigned, and drives its public API.

use futures::future::BoxFuture;
use kvgate_proto::{CapacityReport, PeerReport, PeerReports};

use super::{EngineCapacity, EngineKind, Greedy, get_text, integrity, json, unreadable, vllm};
use crate::capacity::NoReport;
use crate::crd::{Engine, InferenceDeploymentSpec};
use crate::role::Role;

pub struct Kvgate;

impl EngineKind for Kvgate {
    fn engine(&self) -> Engine {
        Engine::Kvgate
    }

    fn default_port(&self) -> u16 {
        kvgate_proto::contract::ROUTER_PORT
    }

    fn health_path(&self) -> &'static str {
        "/healthz"
    }

    fn roles(&self, _: &InferenceDeploymentSpec) -> &'static [Role] {
        &[Role::Prefill, Role::Decode]
    }

    fn api_role(&self, _: &InferenceDeploymentSpec) -> Role {
        Role::Router
    }

    fn integrity(&self) -> bool {
        true
    }

    fn integrity_counters(&self, _: &InferenceDeploymentSpec) -> &'static [integrity::Counter] {
        &[integrity::HANDOFF_MISMATCHES]
    }

    fn read<'a>(&'a self, _: &'a reqwest::Client, _: String) -> BoxFuture<'a, Result<EngineCapacity, NoReport>> {
        Box::pin(async { Err(NoReport::waiting("a kvgate worker reports through its signed capacity report")) })
    }

    /// Through the public API (`return_token_ids`, as vLLM's): what `check` asks of a router.
    fn greedy(&self, model: &str, q: &Greedy<'_>) -> Option<(&'static str, serde_json::Value)> {
        Some((vllm::COMPLETIONS, vllm::greedy(model, q.prompt, q.max_tokens, q.ignore_eos)))
    }

    fn tokens(&self, body: &str) -> Result<Vec<u32>, String> {
        vllm::tokens(body)
    }
}

/// What a kvgate router's peers (or one prefill or decode worker) measured, read without a nonce,
/// and the smallest vocabulary they serve (the canary's prompts stay inside it): for `kubectl
/// kvgate check` only, which holds no deployment secret. The operator never believes such a
/// read; it asks each pod for a report signed for it.
pub async fn unsigned_capacity(http: &reqwest::Client, base: &str) -> Result<(EngineCapacity, Option<u32>), NoReport> {
    let pools = format!("{base}{}", kvgate_proto::KV_POOL_PATH);
    let body = get_text(http, &pools).await?;
    let models = format!("{base}{}", vllm::MODELS);
    let model = json(&get_text(http, &models).await?).ok().and_then(|v| v.pointer("/data/0/id")?.as_str().map(String::from)).unwrap_or_default();
    pooled(&body, model).map_err(|why| unreadable(pools, why))
}

/// The smallest pool of a router's reachable peers, or of one worker's own report, and the
/// smallest vocabulary among them.
fn pooled(body: &str, model: String) -> Result<(EngineCapacity, Option<u32>), String> {
    let (tokens, vocab, detail) = if let Ok(peers) = serde_json::from_str::<PeerReports>(body) {
        let reports = |of: &[PeerReport]| -> Vec<CapacityReport> { of.iter().filter_map(|p| p.report.clone()).collect() };
        let (prefill, decode) = (reports(&peers.prefill), reports(&peers.decode));
        let all: Vec<&CapacityReport> = prefill.iter().chain(&decode).collect();
        let smallest = all.iter().map(|r| r.capacity_tokens).min().ok_or("no reachable prefill or decode peer behind this router")?;
        let pools = |rs: &[CapacityReport]| rs.iter().map(|r| r.capacity_tokens).collect::<Vec<_>>();
        let detail = format!("prefill pools {:?}, decode pools {:?}; read unsigned", pools(&prefill), pools(&decode));
        (smallest, all.iter().filter_map(|r| r.vocab_size).min(), detail)
    } else {
        let r: CapacityReport = serde_json::from_str(body).map_err(|e| format!("neither a router's peer reports nor a worker's capacity report: {e}"))?;
        (r.capacity_tokens, r.vocab_size, format!("{} pages of {} tokens, {}; read unsigned", r.num_pages, r.page_size, r.dtype))
    };
    Ok((EngineCapacity { engine: crate::crd::Engine::Kvgate, tokens, field: "capacity_tokens".into(), model, detail }, vocab))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(tokens: u64, vocab: u32) -> serde_json::Value {
        serde_json::json!({
            "capacity_tokens": tokens, "page_size": 16, "num_pages": tokens / 16, "bytes_per_token": 64, "device": "cpu", "dtype": "f32",
            "model": "tiny", "model_fingerprint": "m", "layout_fingerprint": "l", "vocab_size": vocab, "instance": "",
        })
    }

    #[test]
    fn a_routers_smallest_reachable_pool_and_vocabulary_or_one_workers_own() {
        let peers = serde_json::json!({
            "prefill": [{ "reachable": true, "report": report(4096, 258) }, { "reachable": false }],
            "decode": [{ "reachable": true, "report": report(2048, 300) }],
        });
        let (c, vocab) = pooled(&peers.to_string(), "tiny".into()).unwrap();
        assert_eq!((c.tokens, vocab, c.field.as_str()), (2048, Some(258), "capacity_tokens"));
        assert_eq!(c.detail, "prefill pools [4096], decode pools [2048]; read unsigned");
        let (c, vocab) = pooled(&report(1024, 258).to_string(), "tiny".into()).unwrap();
        assert_eq!((c.tokens, vocab), (1024, Some(258)));
        let none = serde_json::json!({ "prefill": [{ "reachable": false }], "decode": [] });
        assert_eq!(pooled(&none.to_string(), String::new()).unwrap_err(), "no reachable prefill or decode peer behind this router");
        assert!(pooled("{}", String::new()).unwrap_err().starts_with("neither a router's peer reports nor a worker's capacity report"));
    }
}
