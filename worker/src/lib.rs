//! kvgate's inference worker.

pub mod cli;
pub mod commands;
pub mod cpu;
pub mod engine;
pub mod handoff;
pub mod kv;
pub mod listener;
pub mod metrics;
pub mod model;
pub mod roles;
pub mod server;
pub mod setup;
pub mod tenants;
#[cfg(test)]
mod test_data;
pub mod tokenizer;
