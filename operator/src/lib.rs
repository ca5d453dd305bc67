//! kvgate's operator: reconciles `InferenceDeployment`s into router, prefill and decode
//! workloads, and gates every rollout on the KV pool its pods measure.

pub mod canary;
pub mod capacity;
pub mod check;
pub mod cli;
pub mod conditions;
pub mod crd;
pub mod crdgen;
pub mod engine_check;
pub mod engines;
pub mod gate;
pub mod host_paths;
pub mod index;
pub mod keys;
pub mod labels;
pub mod leader;
pub mod lifecycle;
pub mod metrics;
pub mod plugin_cli;
pub mod rbac;
pub mod reasons;
pub mod reconcile;
pub mod render;
pub mod role;
pub mod rollout_state;
pub mod run;
pub mod scrape;
pub mod tasks;
pub mod watch;
pub mod why;
