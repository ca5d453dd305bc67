//! Least privilege for handoff secrets: the operator never reads a Secret outside its own
//! namespace. One root key lives in a Secret in the operator's namespace (created on first start,
//! read with a namespaced Role); each InferenceDeployment's handoff secret is derived from it and
//! the deployment's UID, so the operator knows every secret it ever generated without reading
//! it back, and verifies reports and signs canary calls with a key it computes. Across the
//! cluster it may only `create` Secrets: it cannot read, list or overwrite anyone's.

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use kvgate_proto::auth::DeploymentKey;
use rand::RngCore;

/// Key of the root key's bytes in its Secret.
pub const ROOT_KEY_FIELD: &str = "root-key";
const DERIVE_CONTEXT: &[u8] = b"kvgate.dev handoff secret of an InferenceDeployment v1\0";

/// The operator's root key. Never logged: `Debug` prints nothing of it.
#[derive(Clone)]
pub struct RootKey([u8; 32]);

impl std::fmt::Debug for RootKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RootKey(..)")
    }
}

impl RootKey {
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        RootKey(bytes)
    }

    /// The handoff secret of the InferenceDeployment with this UID (what its Secret holds): 256
    /// bits as 64 hex digits. Text, because workers trim trailing whitespace from the secret
    /// file (`echo secret > file` must work): raw bytes that happened to end in one would give
    /// the workers another key than the operator's.
    pub fn deployment_secret(&self, uid: &str) -> String {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(DERIVE_CONTEXT);
        h.update(uid.as_bytes());
        h.finalize().to_hex().to_string()
    }

    /// The keys every role of that deployment derives from its secret.
    pub fn deployment_key(&self, uid: &str) -> DeploymentKey {
        DeploymentKey::new(self.deployment_secret(uid).as_bytes()).expect("64 hex digits are a valid secret")
    }
}

/// Reads the root key from Secret `namespace/name`, creating it (32 random bytes) when it does
/// not exist. Two replicas starting at once both end with the one that was created first.
pub async fn load_or_create(client: &kube::Client, namespace: &str, name: &str) -> anyhow::Result<RootKey> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    for _ in 0..3 {
        if let Some(secret) = api.get_opt(name).await.map_err(|e| anyhow::anyhow!("reading the root key Secret {namespace}/{name}: {e}"))? {
            let bytes = secret.data.and_then(|mut d| d.remove(ROOT_KEY_FIELD)).map(|b| b.0).unwrap_or_default();
            let bytes: [u8; 32] = bytes.try_into().map_err(|b: Vec<u8>| {
                anyhow::anyhow!("the root key Secret {namespace}/{name} must hold 32 bytes under `{ROOT_KEY_FIELD}`, it holds {}", b.len())
            })?;
            return Ok(RootKey(bytes));
        }
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some([(crate::labels::MANAGED_BY.to_string(), crate::labels::OPERATOR.to_string())].into()),
                ..Default::default()
            },
            data: Some([(ROOT_KEY_FIELD.to_string(), ByteString(bytes.to_vec()))].into()),
            type_: Some("Opaque".into()),
            ..Default::default()
        };
        match api.create(&PostParams { field_manager: Some(crate::labels::MANAGER.into()), ..Default::default() }, &secret).await {
            Ok(_) => {
                tracing::info!(namespace, name, "created the operator's root key");
                return Ok(RootKey(bytes));
            }
            // Another replica created it first: read theirs.
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => anyhow::bail!("creating the root key Secret {namespace}/{name}: {e}"),
        }
    }
    anyhow::bail!("the root key Secret {namespace}/{name} kept appearing and disappearing")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_deployment_gets_its_own_secret_and_the_same_one_every_time() {
        let root = RootKey([7; 32]);
        let a = root.deployment_secret("uid-a");
        assert_eq!(a, root.deployment_secret("uid-a"));
        assert_ne!(a, root.deployment_secret("uid-b"), "a re-created deployment (new UID) gets a new secret");
        assert_ne!(a, RootKey([8; 32]).deployment_secret("uid-a"), "another root key, other secrets");
        assert_eq!(format!("{root:?}"), "RootKey(..)");
        assert!(a.len() == 64 && a.bytes().all(|b| b.is_ascii_hexdigit()), "{a}: nothing a worker would trim");
    }
}
