//! What the last InferencePool sync found, as its condition says it: what a pass remembers
//! (`memory`) and the next one shows (`decide::status`).

use crate::reasons::Reason;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolCondition {
    pub ok: bool,
    pub reason: Reason,
    pub message: String,
}
