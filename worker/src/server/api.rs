//! OpenAI request bodies, parsed strictly enough to name the field that is wrong.

use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::error::ApiError;
use crate::model::SamplingParams;

/// Most tokens one request may ask to generate.
pub const MAX_TOKENS_LIMIT: u32 = 1 << 20;
/// Most choices (`n`) one request may ask for.
pub const MAX_CHOICES: u32 = 16;
/// Most stop strings (OpenAI's limit).
pub const MAX_STOPS: usize = 4;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 256;

/// `prompt`: a string or token ids, alone or as a batch of one.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Batch(Vec<String>),
    TokenBatch(Vec<Vec<u32>>),
}

/// What one request's prompt is, once the batch of one is unwrapped.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub max_tokens: Option<u32>,
    /// Log-probabilities of each token and this many alternatives.
    pub logprobs: Option<u32>,
    /// Answer with the prompt in front of the completion (and its tokens' log-probabilities).
    #[serde(default)]
    pub echo: bool,
    /// vLLM's extension: each choice also carries `token_ids`, the ids it generated (whole
    /// answers; with `stream` it is refused). What `kubectl kvgate check` compares.
    #[serde(default)]
    pub return_token_ids: bool,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<u32>,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Content,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

/// Fields shared by both endpoints.
#[derive(Debug, Deserialize, Default)]
pub struct Common {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u32>,
    pub stop: Option<Stop>,
    /// vLLM's extension: generate past end-of-sequence tokens, up to `max_tokens`.
    #[serde(default)]
    pub ignore_eos: bool,
}

#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// `stop`: one string or up to four.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// Parses a JSON body; a failure names the field path (`max_tokens`, `messages[1].content`).
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::invalid("body", format!("request body is not valid JSON: {inner}"))
        } else if path == "." {
            // A field of `Common` (flattened, so serde lost its name): parsed alone, it is named.
            match common_field_error(body) {
                Some((field, message)) => ApiError::invalid(field.clone(), format!("invalid `{field}`: {message}")),
                None => ApiError::invalid("body", format!("invalid request: {inner}")),
            }
        } else {
            ApiError::invalid(path.clone(), format!("invalid `{path}`: {inner}"))
        }
    })
}

/// The field of [`Common`] that `body` gets wrong, and why.
fn common_field_error(body: &[u8]) -> Option<(String, String)> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    let e = serde_path_to_error::deserialize::<_, Common>(de).err()?;
    let path = e.path().to_string();
    (path != ".").then(|| (path, e.into_inner().to_string()))
}

impl Common {
    pub fn sampling(&self) -> Result<SamplingParams, ApiError> {
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid("temperature", format!("`temperature` must be between 0 and 2, got {temperature}")));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid("top_p", format!("`top_p` must be in (0, 1], got {top_p}")));
        }
        Ok(SamplingParams { temperature, top_p, seed: self.seed, ignore_eos: self.ignore_eos, ..Default::default() })
    }
}

impl Common {
    /// `n`: how many choices, each generated on its own (from `seed + i` when seeded).
    pub fn choices(&self) -> Result<usize, ApiError> {
        match self.n.unwrap_or(1) {
            n @ 1..=MAX_CHOICES => Ok(n as usize),
            n => Err(ApiError::invalid("n", format!("`n` must be between 1 and {MAX_CHOICES}, got {n}"))),
        }
    }

    /// The stop strings, checked: at most four, none empty.
    pub fn stops(&self) -> Result<Vec<String>, ApiError> {
        let stops = match &self.stop {
            None => vec![],
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stops.len() > MAX_STOPS {
            return Err(ApiError::invalid("stop", format!("`stop` holds at most {MAX_STOPS} strings, got {}", stops.len())));
        }
        if stops.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop", "`stop` strings must not be empty"));
        }
        // Every generated token is matched against every stop string: their length is work.
        if let Some(long) = stops.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::invalid("stop", format!("a `stop` string may be at most {MAX_STOP_BYTES} bytes, got one of {}", long.len())));
        }
        Ok(stops)
    }

    /// Whether the last chunk of a stream carries `usage` (OpenAI's `stream_options`; kvgate
    /// sends it unless told not to).
    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().is_none_or(|o| o.include_usage)
    }
}

/// How many alternatives per position a request may ask for.
pub fn check_top_logprobs(field: &str, value: u32) -> Result<u8, ApiError> {
    let limit = kvgate_proto::logprobs::MAX_TOP_LOGPROBS as u32;
    if value > limit {
        return Err(ApiError::invalid(field, format!("`{field}` must be between 0 and {limit}, got {value}")));
    }
    Ok(value as u8)
}

impl ChatRequest {
    /// `logprobs` + `top_logprobs` as the engine takes them.
    pub fn logprobs(&self) -> Result<Option<u8>, ApiError> {
        match (self.logprobs, self.top_logprobs) {
            (false, Some(_)) => Err(ApiError::invalid("top_logprobs", "`top_logprobs` needs `logprobs: true`")),
            (false, None) => Ok(None),
            (true, top) => Ok(Some(check_top_logprobs("top_logprobs", top.unwrap_or(0))?)),
        }
    }
}

pub fn check_max_tokens(field: &str, value: u32) -> Result<usize, ApiError> {
    if value == 0 || value > MAX_TOKENS_LIMIT {
        return Err(ApiError::invalid(field, format!("`{field}` must be between 1 and {MAX_TOKENS_LIMIT}, got {value}")));
    }
    Ok(value as usize)
}

impl CompletionRequest {
    pub fn prompt_input(&self) -> Result<PromptInput, ApiError> {
        let batch = |n: usize| ApiError::invalid("prompt", format!("`prompt` must be one prompt (batches are not supported), got {n}"));
        let input = match &self.prompt {
            Prompt::Text(t) => PromptInput::Text(t.clone()),
            Prompt::Tokens(ids) => PromptInput::Tokens(ids.clone()),
            Prompt::Batch(v) if v.len() == 1 => PromptInput::Text(v[0].clone()),
            Prompt::TokenBatch(v) if v.len() == 1 => PromptInput::Tokens(v[0].clone()),
            Prompt::Batch(v) => return Err(batch(v.len())),
            Prompt::TokenBatch(v) => return Err(batch(v.len())),
        };
        if input == PromptInput::Tokens(vec![]) {
            return Err(ApiError::invalid("prompt", "`prompt` holds no token ids"));
        }
        Ok(input)
    }
}

impl ChatRequest {
    /// Renders the conversation with a plain role-tagged template the tiny model and generic
    /// checkpoints accept.
    pub fn render(&self) -> Result<String, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages", "`messages` must hold at least one message"));
        }
        let mut out = String::new();
        for (i, m) in self.messages.iter().enumerate() {
            if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "developer" | "tool") {
                return Err(ApiError::invalid(format!("messages[{i}].role"), format!("unknown role `{}`", m.role)));
            }
            let text = match &m.content {
                Content::Text(t) => t.clone(),
                Content::Parts(parts) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => text.push_str(t),
                            _ => {
                                return Err(ApiError::invalid(
                                    format!("messages[{i}].content[{j}]"),
                                    format!("only text parts are supported, got `{}`", p.kind),
                                ));
                            }
                        }
                    }
                    text
                }
            };
            out.push_str(&format!("<|{}|>\n{}\n", m.role, text));
        }
        out.push_str("<|assistant|>\n");
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wrong_type_names_its_field() {
        let e = parse::<CompletionRequest>(br#"{"prompt":"hi","max_tokens":"ten"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(e.message.contains("max_tokens"), "{}", e.message);
        let e = parse::<ChatRequest>(br#"{"messages":[{"role":"user","content":"a"},{"role":"user"}]}"#).unwrap_err();
        assert!(e.message.contains("content") || e.param.as_deref().unwrap().starts_with("messages"), "{}", e.message);
        // The fields both endpoints share are flattened into each; still named.
        for (body, field) in [(&br#"{"prompt":"hi","temperature":"hot"}"#[..], "temperature"), (br#"{"prompt":"hi","ignore_eos":1}"#, "ignore_eos")] {
            let e = parse::<CompletionRequest>(body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{}", e.message);
        }
        let e = parse::<ChatRequest>(br#"{"messages":[],"stream":"yes"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream"), "{}", e.message);
    }

    #[test]
    fn broken_json_is_reported_as_such() {
        let e = parse::<CompletionRequest>(b"{\"prompt\": ").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("body"));
        assert!(e.message.contains("not valid JSON"));
    }

    #[test]
    fn sampling_limits_are_enforced() {
        let c = Common { temperature: Some(3.0), ..Default::default() };
        assert_eq!(c.sampling().unwrap_err().param.as_deref(), Some("temperature"));
        let c = Common { top_p: Some(0.0), ..Default::default() };
        assert_eq!(c.sampling().unwrap_err().param.as_deref(), Some("top_p"));
        let c = Common { n: Some(MAX_CHOICES + 1), ..Default::default() };
        assert_eq!(c.choices().unwrap_err().param.as_deref(), Some("n"));
        let c = Common { stop: Some(Stop::Many(vec!["a".into(); 5])), ..Default::default() };
        assert_eq!(c.stops().unwrap_err().param.as_deref(), Some("stop"));
        assert_eq!(check_max_tokens("max_tokens", 0).unwrap_err().param.as_deref(), Some("max_tokens"));
    }

    #[test]
    fn chat_renders_roles_in_order() {
        let r: ChatRequest =
            parse(br#"{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#).unwrap();
        assert_eq!(r.render().unwrap(), "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n");
        let r: ChatRequest = parse(br#"{"messages":[{"role":"wizard","content":"x"}]}"#).unwrap();
        assert_eq!(r.render().unwrap_err().param.as_deref(), Some("messages[0].role"));
    }
}
