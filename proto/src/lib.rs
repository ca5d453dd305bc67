//! Types that cross kvgate's process boundaries.
//!
//! This crate stays small and free of heavy dependencies: the worker serves these types and the
//! operator reads them, so both must agree on one definition.

pub mod auth;
mod capacity;
pub mod codes;
pub mod contract;
pub mod handoff;
pub mod handoff_id;
pub mod logprobs;
pub mod page_tag;
pub mod polyval;
pub mod refusal;
pub mod roles;
pub mod tenant_id;
pub mod tenant_tag;

pub use capacity::{CapacityReport, KV_POOL_PATH, PeerReport, PeerReports, PrefillTimings};
