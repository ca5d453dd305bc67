//! Log-probabilities of a token, as the model computed them (before temperature or top-p).

use serde::{Deserialize, Serialize};

/// Most alternatives reported per position (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// At one position: the chosen token's log-probability and the most likely tokens there, most
/// likely first (ties by lower id).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    pub logprob: f32,
    #[serde(default)]
    pub top: Vec<(u32, f32)>,
}
