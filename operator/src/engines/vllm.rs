//! vLLM. Two limits: `max_model_len` (`GET /v1/models`; with `--max-model-len -1` vLLM fits it
//! to its KV cache, silently) and the KV cache itself (`vllm:cache_config_info` on `/metrics`,
//! labels `num_gpu_blocks` and `block_size`; one block is reserved, so (blocks - 1) x block_size
//! tokens are usable). A request can use the smaller.

use futures::future::BoxFuture;

use super::{EngineCapacity, EngineKind, Greedy, get_text, ids, integrity, json, unreadable};
use crate::capacity::NoReport;
use crate::crd::{Engine, InferenceDeploymentSpec};
use crate::role::Role;

pub struct Vllm;

impl EngineKind for Vllm {
    fn engine(&self) -> Engine {
        Engine::Vllm
    }

    fn default_port(&self) -> u16 {
        8000
    }

    fn shared_memory(&self) -> bool {
        true
    }

    /// A disaggregated pair moves KV over NIXL: what NIXL counts of failed and expired reads,
    /// and what kvgate's verifying connector counts of blocks that did not verify.
    fn integrity_counters(&self, spec: &InferenceDeploymentSpec) -> &'static [integrity::Counter] {
        if spec.prefill.is_some() { &[integrity::HANDOFF_MISMATCHES, integrity::NIXL_FAILED_TRANSFERS, integrity::NIXL_READ_AFTER_EXPIRY] } else { &[] }
    }

    /// A prefill or decode whose container names a KV connector, unless verifyHandoff is false.
    fn verifies_handoff(&self, spec: &InferenceDeploymentSpec, role: Role) -> bool {
        let Some(e) = spec.external(role).filter(|_| matches!(role, Role::Prefill | Role::Decode)) else { return false };
        spec.worker(role).verify_handoff != Some(false)
            && [&e.container.command, &e.container.args].into_iter().any(|argv| kv_transfer_config(argv.as_deref().unwrap_or_default()).is_some())
    }

    fn read<'a>(&'a self, http: &'a reqwest::Client, base: String) -> BoxFuture<'a, Result<EngineCapacity, NoReport>> {
        Box::pin(async move {
            let (metrics, models) = (format!("{base}{METRICS}"), format!("{base}{MODELS}"));
            let (m, v) = (get_text(http, &metrics).await?, get_text(http, &models).await?);
            capacity(&m, &v).map_err(|why| unreadable(format!("{metrics} and {models}"), why))
        })
    }

    fn greedy(&self, model: &str, q: &Greedy<'_>) -> Option<(&'static str, serde_json::Value)> {
        Some((COMPLETIONS, greedy(model, q.prompt, q.max_tokens, q.ignore_eos)))
    }

    fn tokens(&self, body: &str) -> Result<Vec<u32>, String> {
        tokens(body)
    }
}

/// vLLM's flag naming its KV connector, a JSON object (`--kv-transfer-config '{...}'` or
/// `--kv-transfer-config={...}`).
pub const KV_TRANSFER_CONFIG: &str = "--kv-transfer-config";

/// Where the connector's JSON is in `argv`: its index, and whether it follows the flag's `=`.
pub fn kv_transfer_config(argv: &[String]) -> Option<(usize, bool)> {
    argv.iter().enumerate().find_map(|(i, a)| match a.strip_prefix(KV_TRANSFER_CONFIG)? {
        "" => (i + 1 < argv.len()).then_some((i + 1, false)),
        rest => rest.starts_with('=').then_some((i, true)),
    })
}

pub const METRICS: &str = "/metrics";
pub const MODELS: &str = "/v1/models";
pub const COMPLETIONS: &str = "/v1/completions";
const CACHE_INFO: &str = "vllm:cache_config_info";

/// The labels of the first `vllm:cache_config_info` sample.
fn cache_labels(metrics: &str) -> Result<Vec<(&str, &str)>, String> {
    let line = metrics
        .lines()
        .find(|l| l.strip_prefix(CACHE_INFO).is_some_and(|rest| rest.starts_with('{')))
        .ok_or_else(|| format!("no {CACHE_INFO} sample on /metrics"))?;
    let inner = line.split_once('{').and_then(|(_, rest)| rest.rsplit_once('}')).map(|(labels, _)| labels).unwrap_or_default();
    Ok(inner.split("\",").filter_map(|pair| pair.split_once("=\"")).map(|(k, v)| (k.trim(), v.trim_end_matches('"'))).collect())
}

fn label<'a>(labels: &[(&'a str, &'a str)], name: &str) -> Result<u64, String> {
    let v = labels.iter().find(|(k, _)| *k == name).map(|(_, v)| *v).ok_or_else(|| format!("{CACHE_INFO} has no {name} label"))?;
    v.parse().map_err(|_| format!("{CACHE_INFO} {name}=\"{v}\" is not a number"))
}

pub fn capacity(metrics: &str, models: &str) -> Result<EngineCapacity, String> {
    let labels = cache_labels(metrics)?;
    let (blocks, block_size) = (label(&labels, "num_gpu_blocks")?, label(&labels, "block_size")?);
    let models = json(models)?;
    let model = &models["data"][0];
    let max_model_len = model["max_model_len"].as_u64().ok_or("no data[0].max_model_len on /v1/models")?;
    let cache = blocks.saturating_sub(1) * block_size;
    let detail = format!("KV cache of num_gpu_blocks {blocks} x block_size {block_size} (one block reserved: {cache} tokens), max_model_len {max_model_len}");
    let (tokens, field) = if max_model_len <= cache {
        (max_model_len, "max_model_len".to_string())
    } else {
        (cache, format!("KV cache ((num_gpu_blocks {blocks} - 1) x block_size {block_size})"))
    };
    Ok(EngineCapacity { engine: Engine::Vllm, tokens, field, model: model["id"].as_str().unwrap_or_default().to_string(), detail })
}

/// A greedy completion of token ids, answered with the generated ids (`return_token_ids`).
pub fn greedy(model: &str, prompt: &[u32], max_tokens: u32, ignore_eos: bool) -> serde_json::Value {
    serde_json::json!({ "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": true, "ignore_eos": ignore_eos })
}

pub fn tokens(body: &str) -> Result<Vec<u32>, String> {
    ids(json(body)?.pointer("/choices/0/token_ids"), "choices[0].token_ids")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_smaller_of_the_window_and_the_cache_recorded_from_the_real_server() {
        let rows = [
            // --max-model-len 2048 with a 1 GiB cache: the window is the limit.
            (include_str!("testdata/vllm-metrics-2048.txt"), include_str!("testdata/vllm-models-2048.json"), Ok((2048, "max_model_len"))),
            // --max-model-len -1 with a 1 MiB cache: vLLM fitted the window to 7 usable blocks.
            (include_str!("testdata/vllm-metrics-autofit.txt"), include_str!("testdata/vllm-models-autofit.json"), Ok((896, "max_model_len"))),
            // A window bigger than the cache (as with --num-gpu-blocks-override): the cache is.
            (
                "vllm:cache_config_info{block_size=\"128\",num_gpu_blocks=\"8\"} 1.0\n",
                r#"{"data": [{"id": "m", "max_model_len": 4096}]}"#,
                Ok((896, "KV cache ((num_gpu_blocks 8 - 1) x block_size 128)")),
            ),
            ("vllm:num_requests_waiting 0\n", include_str!("testdata/vllm-models-2048.json"), Err("no vllm:cache_config_info sample on /metrics".to_string())),
            (
                "vllm:cache_config_info{block_size=\"128\",num_gpu_blocks=\"None\"} 1.0\n",
                r#"{"data": []}"#,
                Err("vllm:cache_config_info num_gpu_blocks=\"None\" is not a number".to_string()),
            ),
            (
                "vllm:cache_config_info{block_size=\"128\",num_gpu_blocks=\"8\"} 1.0\n",
                r#"{"data": []}"#,
                Err("no data[0].max_model_len on /v1/models".to_string()),
            ),
        ];
        for (metrics, models, want) in rows {
            let got = capacity(metrics, models).map(|c| (c.tokens, c.field));
            assert_eq!(got.as_ref().map(|(t, f)| (*t, f.as_str())).map_err(String::clone), want, "{models}");
        }
        let c = capacity(include_str!("testdata/vllm-metrics-autofit.txt"), include_str!("testdata/vllm-models-autofit.json")).unwrap();
        assert_eq!(c.detail, "KV cache of num_gpu_blocks 8 x block_size 128 (one block reserved: 896 tokens), max_model_len 896");
        assert_eq!(c.model, "/tmp/vllm/model");
    }

    #[test]
    fn a_completion_gives_its_token_ids() {
        assert_eq!(tokens(include_str!("testdata/vllm-completion-ids.json")).unwrap(), [351; 8]);
    }
}
