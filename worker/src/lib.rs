//! kvgate's inference worker.

pub mod kv;
