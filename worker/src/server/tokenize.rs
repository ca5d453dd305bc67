//! The tokenizer over HTTP, as vLLM serves it: `POST /tokenize`, `POST /detokenize` and
//! `GET /tokenizer_info`. Evaluation harnesses (lm-evaluation-harness's `remote` tokenizer) use
//! them to send token-id prompts without a copy of the tokenizer.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use super::AppState;
use super::api;
use super::error::ApiError;
use crate::tokenizer::{self, Tokenizer};

/// The model's begin- and end-of-sequence tokens as text, where the tokenizer names them.
#[derive(Debug, Clone, Default)]
pub struct SpecialTokens {
    pub bos: Option<String>,
    pub eos: Option<String>,
}

impl SpecialTokens {
    pub fn of(tokenizer: &Tokenizer, bos: Option<u32>, eos: &[u32]) -> Self {
        SpecialTokens { bos: bos.and_then(|id| tokenizer.token(id)), eos: eos.first().and_then(|id| tokenizer.token(*id)) }
    }
}

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    prompt: String,
    #[serde(default = "yes")]
    add_special_tokens: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    tokens: Vec<u32>,
}

pub async fn tokenize(State(state): State<AppState>, body: Bytes) -> Response {
    let result = async {
        let req: TokenizeRequest = api::parse(&body)?;
        let tokens = tokenizer::encode_off_runtime(&state.tokenizer, req.prompt, req.add_special_tokens)
            .await
            .map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
        Ok::<_, ApiError>(Json(json!({ "count": tokens.len(), "max_model_len": state.window, "tokens": tokens })))
    };
    result.await.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

pub async fn detokenize(State(state): State<AppState>, body: Bytes) -> Response {
    let result = async {
        let req: DetokenizeRequest = api::parse(&body)?;
        state.check_vocab("tokens", &req.tokens)?;
        let prompt = tokenizer::decode_off_runtime(&state.tokenizer, req.tokens).await.map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
        Ok::<_, ApiError>(Json(json!({ "prompt": prompt })))
    };
    result.await.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

pub async fn tokenizer_info(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(json!({
        "eos_token": state.special.eos, "bos_token": state.special.bos, "pad_token": null,
        "model_max_length": state.window,
    }))
}
