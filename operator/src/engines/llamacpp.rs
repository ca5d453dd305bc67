//! llama.cpp's server (`llama-server`). Its KV cache is split into `--parallel` slots unless it
//! is unified: `GET /props` says what one request may use, `default_generation_settings.n_ctx`
//! (with `-c 4096 -np 4`: 1024), and how many slots there are. `/metrics` has no capacity.

use futures::future::BoxFuture;

use super::{EngineCapacity, EngineKind, Greedy, count, ids, json, read_one};
use crate::capacity::NoReport;
use crate::crd::Engine;

pub struct Llamacpp;

impl EngineKind for Llamacpp {
    fn engine(&self) -> Engine {
        Engine::Llamacpp
    }

    fn default_port(&self) -> u16 {
        8080
    }

    fn read<'a>(&'a self, http: &'a reqwest::Client, base: String) -> BoxFuture<'a, Result<EngineCapacity, NoReport>> {
        Box::pin(async move { read_one(http, &base, PROPS, capacity).await })
    }

    fn greedy(&self, _: &str, q: &Greedy<'_>) -> Option<(&'static str, serde_json::Value)> {
        Some((COMPLETION, greedy(q.prompt, q.max_tokens, q.ignore_eos)))
    }

    fn tokens(&self, body: &str) -> Result<Vec<u32>, String> {
        tokens(body)
    }
}

pub const PROPS: &str = "/props";
/// The native completion endpoint: it returns the generated token ids.
pub const COMPLETION: &str = "/completion";

pub fn capacity(props: &str) -> Result<EngineCapacity, String> {
    let v = json(props)?;
    let n_ctx = count(&v, "/default_generation_settings/n_ctx").map_err(|e| format!("not a llama.cpp /props answer: {e}"))?;
    let slots = count(&v, "/total_slots").map_err(|e| format!("not a llama.cpp /props answer: {e}"))?;
    let model = v["model_path"].as_str().or(v["model_alias"].as_str()).unwrap_or_default().to_string();
    Ok(EngineCapacity { engine: Engine::Llamacpp, tokens: n_ctx, field: "n_ctx per slot".into(), model, detail: format!("{slots} slots of {n_ctx} tokens") })
}

/// A greedy completion of token ids, answered with the generated ids.
pub fn greedy(prompt: &[u32], max_tokens: u32, ignore_eos: bool) -> serde_json::Value {
    serde_json::json!({
        "prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
        "return_tokens": true, "cache_prompt": false, "ignore_eos": ignore_eos,
    })
}

pub fn tokens(body: &str) -> Result<Vec<u32>, String> {
    ids(json(body)?.get("tokens"), "tokens")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn props_name_the_per_slot_window_recorded_from_the_real_server() {
        let rows = [
            // llama-server -c 4096 -np 4: four slots of 1,024 tokens (the incident in miniature).
            (include_str!("testdata/llamacpp-props-np4.json"), Ok((1024, "4 slots of 1024 tokens"))),
            // The same with a unified KV cache: every slot may use all 4,096.
            (include_str!("testdata/llamacpp-props-np4-unified.json"), Ok((4096, "4 slots of 4096 tokens"))),
            (r#"{"total_slots": 4}"#, Err("not a llama.cpp /props answer: no non-negative integer at /default_generation_settings/n_ctx")),
            (
                r#"{"default_generation_settings": {"n_ctx": -1}, "total_slots": 1}"#,
                Err("not a llama.cpp /props answer: no non-negative integer at /default_generation_settings/n_ctx"),
            ),
            ("<html>", Err("not JSON: expected value at line 1 column 1")),
        ];
        for (body, want) in rows {
            let got = capacity(body).map(|c| (c.tokens, c.detail));
            assert_eq!(got.as_ref().map(|(t, d)| (*t, d.as_str())).map_err(String::as_str), want, "{body:.80}");
        }
        let c = capacity(include_str!("testdata/llamacpp-props-np4.json")).unwrap();
        assert_eq!((c.field.as_str(), c.model.as_str()), ("n_ctx per slot", "tiny.gguf"));
    }

    #[test]
    fn a_completion_gives_its_token_ids() {
        assert_eq!(tokens(include_str!("testdata/llamacpp-completion-tokens.json")).unwrap().len(), 8);
        assert!(tokens(r#"{"content": "x"}"#).unwrap_err().contains("no tokens"));
    }
}
