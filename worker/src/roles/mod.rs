//! The three worker roles of a disaggregated deployment, and the HTTP calls between them.

pub mod decode;
pub mod discovery;
pub mod internal_auth;
pub mod peers;
pub mod prefill;
pub mod router;

/// Internal endpoints (not part of the public API).
pub const RESERVE_PATH: &str = "/internal/v1/reserve";
pub const PREFILL_PATH: &str = "/internal/v1/prefill";

pub fn cancel_path(id: &str) -> String {
    format!("/internal/v1/handoffs/{id}/cancel")
}

pub fn generate_path(id: &str) -> String {
    format!("/internal/v1/handoffs/{id}/generate")
}
