//! Keeps the optional `InferencePool` in line with `spec.inferencePool` and says how it stands
//! in the condition `InferencePoolReady`. Its CRD is not the operator's and may be missing, and
//! its RBAC may lag behind an upgrade: either is a False condition and a Warning Event, never a
//! failed pass (the deployment serves without a gateway, and its rollouts go on). Each pass's
//! apply compares the pool with what the spec asks and writes only what differs. It reads the
//! pool from the watch (`watch::inference_pools`) once that has listed, and with one GET while it
//! has not (the type is not served, or the watch is recovering); a pass runs at least every 30 s,
//! so a CRD installed later is picked up within that.
//!
//! The condition is decided like every other (`decide`), from what the last sync found
//! (remembered per deployment, `Memory::pool_synced`): a sync whose finding changed wakes the
//! next pass, which writes it.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use std::sync::Arc;

use kube::ResourceExt;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};

use super::context::{Context, Error};
use crate::crd::InferenceDeployment;
use crate::labels::MANAGER;
use crate::reasons::Reason;
use crate::render::inference_pool::{self, GROUP, KIND, VERSION};
use crate::watch::inference_pools::Seen;

pub const CONDITION: &str = "InferencePoolReady";

/// What a pass did, for the condition and the Event of a change.
#[derive(Debug)]
pub enum Outcome {
    /// The spec asks for no pool and none of this deployment's exists.
    NotWanted,
    /// The pool holds what the spec asks.
    Applied { name: String },
    /// The API server does not serve the InferencePool type.
    NotServed,
    /// Reading, applying or deleting it failed (forbidden, rejected, API unavailable).
    Failed(Error),
}

fn api(ctx: &Context, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(ctx.client.clone(), ns, &inference_pool::api_resource())
}

/// Applies, or deletes when no longer asked for, the deployment's pool.
pub async fn sync(ctx: &Context, d: &InferenceDeployment, ns: &str, had_condition: bool) -> Outcome {
    attempt(ctx, d, ns, had_condition).await.unwrap_or_else(Outcome::Failed)
}

async fn attempt(ctx: &Context, d: &InferenceDeployment, ns: &str, had_condition: bool) -> Result<Outcome, Error> {
    let api = api(ctx, ns);
    let name = d.name_any();
    let Some(pool) = inference_pool::pool(d) else {
        // Only a pool this deployment owns is deleted (the condition says one was made).
        if had_condition {
            match read(ctx, &api, ns, &name).await {
                Ok(Some(p)) if p.owner_references().iter().any(|o| Some(&o.uid) == d.uid().as_ref()) => {
                    match api.delete(&name, &DeleteParams::background()).await {
                        Ok(_) => {}
                        Err(e) if not_found(&e) => {}
                        Err(e) => return Err(Error::api(format!("deleting {KIND} {name}"))(e)),
                    }
                }
                Ok(_) => {}
                Err(e) if not_found(&e) => {}
                Err(e) => return Err(Error::api(format!("reading {KIND} {name}"))(e)),
            }
        }
        return Ok(Outcome::NotWanted);
    };
    // A DynamicObject made for the pool's ApiResource carries its apiVersion and kind.
    let body = serde_json::to_value(&pool).expect("k8s objects serialize");
    match read(ctx, &api, ns, &name).await {
        Ok(Some(seen)) if crate::watch::diff::holds(&serde_json::to_value(&*seen).unwrap_or_default(), &body) => {
            return Ok(Outcome::Applied { name });
        }
        Ok(_) => {}
        Err(e) if not_found(&e) => {}
        Err(e) => return Err(Error::api(format!("reading {KIND} {name}"))(e)),
    }
    match api.patch(&name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(&body)).await {
        Ok(_) => Ok(Outcome::Applied { name }),
        // An apply creates a missing object: a 404 here means the type itself is missing.
        Err(e) if not_found(&e) => Ok(Outcome::NotServed),
        Err(e) => Err(Error::api(format!("applying {KIND} {name}"))(e)),
    }
}

/// The pool as the watch last saw it, or as one GET finds it while the watch has not listed.
async fn read(ctx: &Context, api: &Api<DynamicObject>, ns: &str, name: &str) -> Result<Option<Arc<DynamicObject>>, kube::Error> {
    match ctx.stores.inference_pools.get(ns, name) {
        Seen::Known(pool) => Ok(pool),
        Seen::Unknown => Ok(api.get_opt(name).await?.map(Arc::new)),
    }
}

/// A 404: the object is missing, or its type is not served (then the body is not even a Status,
/// which `get_opt` does not take for "missing").
fn not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

pub use super::pool_condition::PoolCondition;

/// The condition for an outcome (`None`: no condition, the spec asks for no pool).
pub fn condition(d: &InferenceDeployment, outcome: &Outcome) -> Option<PoolCondition> {
    let picker = d.spec.inference_pool.as_ref().map(|p| format!("{}:{}", p.endpoint_picker.name, p.endpoint_picker.port)).unwrap_or_default();
    let (ok, reason, message) = match outcome {
        Outcome::NotWanted => return None,
        Outcome::Applied { name } => {
            (true, Reason::Applied, format!("{KIND} {name} selects the pods that serve this deployment's API; endpoint picker Service {picker}"))
        }
        Outcome::NotServed => (
            false,
            Reason::CrdNotInstalled,
            format!(
                "spec.inferencePool is set, but the API server does not serve {GROUP}/{VERSION} {KIND}: install the Gateway API Inference Extension's CRDs (v1.0 or later); the deployment serves without it"
            ),
        ),
        Outcome::Failed(e) => (false, e.reason(), format!("{e}; the deployment serves without it, retried every pass")),
    };
    Some(PoolCondition { ok, reason, message })
}

/// Whether what a sync found says something else than the condition status holds.
pub fn differs(found: Option<&PoolCondition>, shown: Option<&Condition>) -> bool {
    match (found, shown) {
        (None, None) => false,
        (Some(f), Some(c)) => (c.status == "True") != f.ok || c.reason != f.reason.as_str() || c.message != f.message,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn each_outcome_has_its_condition_and_a_failure_names_its_cause_without_failing_the_pass() {
        let d = InferenceDeployment::for_test(json!({
            "model": { "name": "tiny" }, "contextWindow": 64, "prefill": { "kvPool": {} }, "decode": { "kvPool": {} },
            "inferencePool": { "endpointPicker": { "name": "epp" } },
        }));
        assert!(condition(&d, &Outcome::NotWanted).is_none());
        let applied = condition(&d, &Outcome::Applied { name: "llm".into() }).unwrap();
        assert!(applied.ok && applied.reason == Reason::Applied && applied.message.contains("epp:9002"), "{applied:?}");
        let missing = condition(&d, &Outcome::NotServed).unwrap();
        assert!(!missing.ok && missing.reason == Reason::CrdNotInstalled);
        let forbidden = kube::Error::Api(kube::core::Status::failure("no", "Forbidden").with_code(403).boxed());
        let failed = condition(&d, &Outcome::Failed(Error::api("applying InferencePool llm")(forbidden))).unwrap();
        assert!(!failed.ok && failed.reason == Reason::Forbidden && failed.message.starts_with("applying InferencePool llm: forbidden"), "{failed:?}");

        // A finding is news only when status does not already say it (a first sync that finds
        // no pool wanted wakes nothing).
        let mut conds = Vec::new();
        assert!(!differs(None, None));
        assert!(differs(Some(&applied), None));
        let at = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
        crate::conditions::set(&mut conds, CONDITION, true, applied.reason, applied.message.clone(), None, &at);
        assert!(!differs(Some(&applied), conds.first()));
        assert!(differs(Some(&missing), conds.first()) && differs(None, conds.first()));
    }
}
