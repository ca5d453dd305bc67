//! The handoff Secret the operator generates when the spec names none.

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use rand::RngCore;

use super::{labels, name, owned_meta};
use crate::crd::InferenceDeployment;

/// Key of the secret's bytes in the Secret.
pub const KEY: &str = "secret";

/// The Secret decode pods mount: the named one, or ours.
pub fn secret_name(d: &InferenceDeployment) -> String {
    d.spec.handoff.secret_name.clone().unwrap_or_else(|| format!("{}-handoff", name(d)))
}

/// A new Secret with 32 random bytes; created once and never rewritten (rewriting it would
/// invalidate every in-flight reservation).
pub fn generated(d: &InferenceDeployment) -> Secret {
    let mut bytes = vec![0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    Secret {
        metadata: owned_meta(d, secret_name(d), labels::common(name(d))),
        data: Some([(KEY.to_string(), ByteString(bytes))].into()),
        type_: Some("Opaque".into()),
        ..Default::default()
    }
}
