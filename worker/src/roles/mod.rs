//! The three worker roles of a disaggregated deployment, and the HTTP calls between them.

pub mod decode;
pub mod discovery;
pub mod internal_auth;
pub mod peers;
pub mod prefill;
pub mod prefill_rate;
pub mod router;

/// Internal endpoints (not part of the public API); the operator's canary calls them too.
pub use kvgate_proto::roles::{PREFILL_PATH, RESERVE_PATH, cancel_path, generate_path};
