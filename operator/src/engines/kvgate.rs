//! kvgate's own router, prefill and decode workers: handoff integrity end to end. Their
//! capacity comes from signed reports (`capacity.rs`), their canary drives prefill x decode pairs
//! (`canary/pair.rs`), and their mismatch counters judge a bake.

use futures::future::BoxFuture;

use super::{EngineCapacity, EngineKind, Greedy, integrity};
use crate::capacity::NoReport;
use crate::crd::{Engine, InferenceDeploymentSpec};
use crate::role::Role;

pub struct Kvgate;

impl EngineKind for Kvgate {
    fn engine(&self) -> Engine {
        Engine::Kvgate
    }

    fn default_port(&self) -> u16 {
        kvgate_proto::contract::ROUTER_PORT
    }

    fn health_path(&self) -> &'static str {
        "/healthz"
    }

    fn roles(&self, _: &InferenceDeploymentSpec) -> &'static [Role] {
        &[Role::Prefill, Role::Decode]
    }

    fn api_role(&self, _: &InferenceDeploymentSpec) -> Role {
        Role::Router
    }

    fn integrity(&self) -> bool {
        true
    }

    fn integrity_counters(&self, _: &InferenceDeploymentSpec) -> &'static [integrity::Counter] {
        &[integrity::HANDOFF_MISMATCHES]
    }

    fn read<'a>(&'a self, _: &'a reqwest::Client, _: String) -> BoxFuture<'a, Result<EngineCapacity, NoReport>> {
        Box::pin(async { Err(NoReport::waiting("a kvgate worker reports through its signed capacity report")) })
    }

    fn greedy(&self, _: &str, _: &Greedy<'_>) -> Option<(&'static str, serde_json::Value)> {
        None
    }

    fn tokens(&self, _: &str) -> Result<Vec<u32>, String> {
        Err("kvgate's canary drives prefill x decode pairs".into())
    }
}
