//! kvgate's operator: reconciles `InferenceDeployment`s into router, prefill and decode
//! workloads, and gates every rollout on the KV pool its pods measure.

pub mod crd;
pub mod cli;
pub mod crdgen;
pub mod gate;
pub mod host_paths;
pub mod render;
pub mod capacity;
pub mod conditions;
pub mod leader;
pub mod metrics;
pub mod reconcile;
pub mod run;
pub mod rbac;
