//! Which request fields the API honours. A field it does not implement is answered 400 naming
//! it, unless it holds the value that changes nothing (a zero penalty, an empty `logit_bias`):
//! a client must never believe a setting applied when it did not.

use serde_json::Value;

use super::error::ApiError;

/// Fields both endpoints honour, then each endpoint's own.
const COMMON: &[&str] = &["model", "max_tokens", "temperature", "top_p", "seed", "stream", "stream_options", "n", "stop", "logprobs", "user", "ignore_eos"];
const COMPLETIONS: &[&str] = &["prompt", "echo", "return_token_ids"];
const CHAT: &[&str] = &["messages", "max_completion_tokens", "top_logprobs"];

/// Known fields this API does not implement, with the value that is the same as leaving them out.
fn neutral(field: &str, value: &Value) -> bool {
    match field {
        "presence_penalty" | "frequency_penalty" => value.as_f64() == Some(0.0),
        "best_of" => value.as_u64() == Some(1),
        "logit_bias" | "metadata" => value.as_object().is_some_and(|o| o.is_empty()),
        "suffix" | "tools" | "tool_choice" | "functions" | "function_call" | "response_format" => {
            value.is_null() || (field == "response_format" && value["type"] == "text")
        }
        _ => false,
    }
}

/// Refuses a body with a field that would be ignored. `chat` picks the endpoint's field list.
pub fn check(body: &[u8], chat: bool) -> Result<(), ApiError> {
    let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(body) else { return Ok(()) }; // the typed parse names the problem
    let own = if chat { CHAT } else { COMPLETIONS };
    for (field, value) in &map {
        if COMMON.contains(&field.as_str()) || own.contains(&field.as_str()) || value.is_null() || neutral(field, value) {
            continue;
        }
        return Err(ApiError::invalid(field.clone(), format!("`{field}` is not supported by kvgate (got {value}); leave it out")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_fields_are_named_and_neutral_values_pass() {
        let e = check(br#"{"prompt":"a","presence_penalty":0.5}"#, false).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("presence_penalty"));
        assert!(check(br#"{"prompt":"a","presence_penalty":0,"logit_bias":{},"best_of":1}"#, false).is_ok());
        assert_eq!(check(br#"{"messages":[],"tools":[{"type":"function"}]}"#, true).unwrap_err().param.as_deref(), Some("tools"));
        assert_eq!(check(br#"{"prompt":"a","top_logprobs":2}"#, false).unwrap_err().param.as_deref(), Some("top_logprobs"));
        assert_eq!(check(br#"{"prompt":"a","frobnicate":true}"#, false).unwrap_err().param.as_deref(), Some("frobnicate"));
    }
}
