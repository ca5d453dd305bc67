//! kvgate's inference worker.

pub mod kv;
pub mod model;
pub mod tokenizer;
