//! A revision: a hash of everything that shapes prefill and decode pods. A new revision is a new
//! pair of Deployments that must pass the gate before it serves.

use sha2::{Digest, Sha256};

use crate::crd::InferenceDeploymentSpec;

/// 10 hex digits of SHA-256 over the worker-shaping fields (the router's own settings and the
/// replica counts are not part of it: scaling is not a rollout).
pub fn of(spec: &InferenceDeploymentSpec, image: &str) -> String {
    let mut prefill = spec.prefill.clone();
    let mut decode = spec.decode.clone();
    prefill.replicas = 0;
    decode.replicas = 0;
    let shaping = serde_json::json!({
        "model": spec.model, "contextWindow": spec.context_window, "image": image,
        "prefill": prefill, "decode": decode, "handoff": spec.handoff,
    });
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
        s.prefill.replicas = 5;
        s.router.replicas = 3;
        assert_eq!(of(&s, "img"), base);
        let mut s = spec();
        s.prefill.kv_pool.tokens = Some(8192);
        assert_ne!(of(&s, "img"), base);
        let mut s = spec();
        s.context_window = 512;
        assert_ne!(of(&s, "img"), base);
        assert_ne!(of(&spec(), "img2"), base);
    }
}
