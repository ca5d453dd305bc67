//! A revision: a hash of everything that shapes prefill and decode pods. A new revision is a new
//! pair of Deployments that must pass the gate before it serves.

use sha2::{Digest, Sha256};

use crate::crd::{InferenceDeploymentSpec, RouterRole, ServerRole, WorkerRole};

/// 10 hex digits of SHA-256 over the pod-shaping fields (the router's own settings and the
/// replica counts are not part of it: scaling is not a rollout).
pub fn of(spec: &InferenceDeploymentSpec, image: &str) -> String {
    let unscaled = |w: &Option<WorkerRole>| w.clone().map(|w| WorkerRole { replicas: 0, ..w });
    let shaping = if spec.engine().integrity() {
        serde_json::json!({
            "model": spec.model, "contextWindow": spec.context_window, "image": image,
            "prefill": unscaled(&spec.prefill), "decode": unscaled(&spec.decode), "handoff": spec.handoff,
        })
    } else {
        // A disaggregated engine's router is part of its revision (kvgate's is not).
        let router = spec.prefill.is_some().then(|| RouterRole { replicas: 0, ..spec.router.clone() });
        let mut shaping = serde_json::json!({
            "engine": spec.engine, "model": spec.model, "contextWindow": spec.context_window,
            "server": spec.server.clone().map(|s| ServerRole { replicas: 0, ..s }),
        });
        if router.is_some() {
            // Added only when disaggregated: a single server's revision hash stays what it was.
            shaping["prefill"] = serde_json::json!(unscaled(&spec.prefill));
            shaping["decode"] = serde_json::json!(unscaled(&spec.decode));
            shaping["router"] = serde_json::json!(router);
        }
        shaping
    };
    let digest = Sha256::digest(shaping.to_string().as_bytes());
    digest.iter().take(5).map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::InferenceDeploymentSpec;

    fn spec() -> InferenceDeploymentSpec {
        serde_json::from_value(serde_json::json!({
            "model": { "name": "tiny" }, "contextWindow": 1024,
            "prefill": { "kvPool": { "tokens": 4096 } }, "decode": { "kvPool": { "tokens": 4096 } },
        }))
        .unwrap()
    }

    #[test]
    fn pool_and_window_changes_are_new_revisions_scaling_is_not() {
        let base = of(&spec(), "img");
        assert_eq!(base.len(), 10);
        let mut s = spec();
        s.prefill.as_mut().unwrap().replicas = 5;
        s.router.replicas = 3;
        assert_eq!(of(&s, "img"), base);
        let mut s = spec();
        s.prefill.as_mut().unwrap().kv_pool.as_mut().unwrap().tokens = Some(8192);
        assert_ne!(of(&s, "img"), base);
        let mut s = spec();
        s.context_window = 512;
        assert_ne!(of(&s, "img"), base);
        assert_ne!(of(&spec(), "img2"), base);
    }
}
