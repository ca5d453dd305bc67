//! SGLang, read from its source (it needs CUDA or an AMX CPU kernel: it cannot run on these
//! machines). `GET /get_server_info` returns its server arguments merged with the scheduler's
//! init info (`python/sglang/srt/entrypoints/http_server.py`, `get_server_info`; the
//! scheduler's `get_init_info`): `max_total_num_tokens` (the KV pool), `max_req_input_len`
//! (`min(context_len - 1, max_total_num_tokens - 1)`, the tp worker) and `context_length` (the
//! server argument; null when the model's own is used). A request can use
//! `max_req_input_len + 1` tokens, which is never more than either of the other two. Read at
//! sgl-project/sglang, SGLang 0.5.x (the v0.5.22 that fixed the incident keeps these fields).

use futures::future::BoxFuture;

use super::{EngineCapacity, EngineKind, Greedy, count, ids, json, read_one};
use crate::capacity::NoReport;
use crate::crd::Engine;

pub struct Sglang;

impl EngineKind for Sglang {
    fn engine(&self) -> Engine {
        Engine::Sglang
    }

    fn default_port(&self) -> u16 {
        30000
    }

    fn shared_memory(&self) -> bool {
        true
    }

    fn read<'a>(&'a self, http: &'a reqwest::Client, base: String) -> BoxFuture<'a, Result<EngineCapacity, NoReport>> {
        Box::pin(async move { read_one(http, &base, SERVER_INFO, capacity).await })
    }

    fn greedy(&self, _: &str, q: &Greedy<'_>) -> Option<(&'static str, serde_json::Value)> {
        Some((GENERATE, greedy(q.prompt, q.max_tokens, q.ignore_eos)))
    }

    fn tokens(&self, body: &str) -> Result<Vec<u32>, String> {
        tokens(body)
    }
}

pub const SERVER_INFO: &str = "/get_server_info";
pub const GENERATE: &str = "/generate";

pub fn capacity(server_info: &str) -> Result<EngineCapacity, String> {
    let v = json(server_info)?;
    let not = |e: String| format!("not an SGLang /get_server_info answer: {e}");
    let pool = count(&v, "/max_total_num_tokens").map_err(not)?;
    let input = count(&v, "/max_req_input_len").map_err(not)?;
    let context = v["context_length"].as_u64();
    let mut limits = vec![(pool, "max_total_num_tokens"), (input + 1, "max_req_input_len + 1")];
    limits.extend(context.map(|c| (c, "context_length")));
    let (tokens, field) = limits.iter().min_by_key(|(t, _)| *t).copied().expect("two limits at least");
    let model = v["served_model_name"].as_str().or(v["model_path"].as_str()).unwrap_or_default().to_string();
    let context_text = context.map_or("the model's".to_string(), |c| c.to_string());
    Ok(EngineCapacity {
        engine: Engine::Sglang,
        tokens,
        field: field.into(),
        model,
        detail: format!("max_total_num_tokens {pool}, max_req_input_len {input}, context_length {context_text}"),
    })
}

/// A greedy generation from token ids; the ids come back in the log-probabilities
/// (`meta_info.output_token_logprobs`: `[logprob, token_id, text]` per token).
pub fn greedy(prompt: &[u32], max_tokens: u32, ignore_eos: bool) -> serde_json::Value {
    serde_json::json!({ "input_ids": prompt, "sampling_params": { "max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": ignore_eos }, "return_logprob": true })
}

pub fn tokens(body: &str) -> Result<Vec<u32>, String> {
    let v = json(body)?;
    let per_token =
        v.pointer("/meta_info/output_token_logprobs").and_then(serde_json::Value::as_array).ok_or("no meta_info.output_token_logprobs in the answer")?;
    let ids_only: Vec<serde_json::Value> = per_token.iter().map(|t| t[1].clone()).collect();
    ids(Some(&serde_json::Value::Array(ids_only)), "output_token_logprobs token ids")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fields of `/get_server_info` this adapter reads, as SGLang's source builds them: the
    /// server arguments (`context_length`, `model_path`, `served_model_name`, ...) merged with
    /// the scheduler's init info. Constructed from the source, not recorded (see the module).
    fn info(pool: u64, input: u64, context: Option<u64>) -> String {
        serde_json::json!({
            "model_path": "/models/qwen", "served_model_name": "qwen", "context_length": context, "page_size": 1,
            "max_total_num_tokens": pool, "max_req_input_len": input, "status": "ready", "version": "0.5.22",
            "internal_states": [{ "last_gen_throughput": 0.0 }],
        })
        .to_string()
    }

    #[test]
    fn the_smallest_limit_names_itself() {
        let rows = [
            // sglang #4048: --context-length 163840 while the pool held 59,862 tokens.
            (info(59_862, 59_861, Some(163_840)), Ok((59_862, "max_total_num_tokens"))),
            // A pool bigger than the window: the window (max_req_input_len + 1 = context_length).
            (info(1_000_000, 32_767, Some(32_768)), Ok((32_768, "max_req_input_len + 1"))),
            (info(1_000_000, 131_071, None), Ok((131_072, "max_req_input_len + 1"))),
            (
                r#"{"max_total_num_tokens": 10}"#.to_string(),
                Err("not an SGLang /get_server_info answer: no non-negative integer at /max_req_input_len".to_string()),
            ),
        ];
        for (body, want) in rows {
            let got = capacity(&body).map(|c| (c.tokens, c.field));
            assert_eq!(got.as_ref().map(|(t, f)| (*t, f.as_str())).map_err(String::clone), want, "{body}");
        }
        assert_eq!(capacity(&info(59_862, 59_861, Some(163_840))).unwrap().model, "qwen");
    }

    #[test]
    fn generated_ids_come_from_the_log_probabilities() {
        let body = r#"{"text": "ab", "meta_info": {"output_token_logprobs": [[-0.1, 17, null], [-0.2, 4, null]]}}"#;
        assert_eq!(tokens(body).unwrap(), [17, 4]);
        assert!(tokens(r#"{"text": "ab"}"#).is_err());
    }
}
