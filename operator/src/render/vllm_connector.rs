//! kvgate's verifying KV connector inside a disaggregated vLLM (engines/vllm): the connector the
//! user's `--kv-transfer-config` names becomes the inner connector of `KvgateConnector`, keyed
//! with the deployment's handoff secret.
//!
//! The package reaches the pods in a ConfigMap the operator writes from the files compiled into
//! it, mounted on `PYTHONPATH`: the user's vLLM image stays as it is, no init container or second
//! image is pulled per pod, and the connector a pod runs is always the one the operator that
//! rendered the pod was built with (the ConfigMap's name carries its digest, so a new connector
//! is a new revision, gated like any other).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ConfigMap, ConfigMapVolumeSource, Container, EnvVar, Volume, VolumeMount};

use super::workers::handoff_secret;
use super::{SECRET_DIR, name, owned_meta, secret};
use crate::crd::InferenceDeployment;
use crate::engines::vllm::kv_transfer_config;
use crate::gate::Role;
use crate::labels;

/// The package's files, as engines/vllm/kvgate_vllm holds them.
const FILES: [(&str, &str); 6] = [
    ("__init__.py", include_str!("../../../engines/vllm/kvgate_vllm/__init__.py")),
    ("connector.py", include_str!("../../../engines/vllm/kvgate_vllm/connector.py")),
    ("digest.py", include_str!("../../../engines/vllm/kvgate_vllm/digest.py")),
    ("faults.py", include_str!("../../../engines/vllm/kvgate_vllm/faults.py")),
    ("handoff.py", include_str!("../../../engines/vllm/kvgate_vllm/handoff.py")),
    ("metrics.py", include_str!("../../../engines/vllm/kvgate_vllm/metrics.py")),
];

/// Where the package is importable from in the engine's container.
pub const PYTHON_DIR: &str = "/opt/kvgate/python";
const VOLUME: &str = "kvgate-vllm-connector";

/// The package's digest, hashed once per process (every reconcile of a verifying deployment
/// names the ConfigMap).
static DIGEST8: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let mut h = blake3::Hasher::new();
    for (file, text) in FILES {
        h.update(file.as_bytes()).update(&[0]).update(text.as_bytes()).update(&[0]);
    }
    h.finalize().to_hex()[..8].to_string()
});

/// `NAME-vllm-connector-DIGEST8`: the ConfigMap holding the package.
pub fn config_map_name(d: &InferenceDeployment) -> String {
    format!("{}-vllm-connector-{}", name(d), *DIGEST8)
}

/// The ConfigMap, owned by the deployment (created once per digest, never rewritten).
pub fn config_map(d: &InferenceDeployment) -> ConfigMap {
    ConfigMap {
        metadata: owned_meta(d, config_map_name(d), labels::common(name(d))),
        data: Some(FILES.iter().map(|(file, text)| (file.to_string(), text.to_string())).collect::<BTreeMap<_, _>>()),
        immutable: Some(true),
        ..Default::default()
    }
}

/// The connector configuration that wraps the user's: its connector fields move under
/// `kv_connector_extra_config.inner`, the rest (kv_role, buffers, the load-failure policy) stay
/// where vLLM reads them, the policy defaulting to `fail`. None when `config` is not a JSON
/// object (vLLM refuses it at start, naming the flag) or already names KvgateConnector.
pub fn wrap(config: &str, role: Role) -> Option<String> {
    let serde_json::Value::Object(mut outer) = serde_json::from_str(config).ok()? else { return None };
    if outer.get("kv_connector").and_then(serde_json::Value::as_str) == Some("KvgateConnector") {
        return None;
    }
    let mut inner = serde_json::Map::new();
    for key in ["kv_connector", "kv_connector_module_path", "kv_connector_extra_config"] {
        if let Some(v) = outer.remove(key) {
            inner.insert(key.into(), v);
        }
    }
    outer.insert("kv_connector".into(), "KvgateConnector".into());
    outer.insert("kv_connector_module_path".into(), "kvgate_vllm.connector".into());
    outer.entry("kv_load_failure_policy").or_insert("fail".into());
    outer.insert(
        "kv_connector_extra_config".into(),
        serde_json::json!({ "inner": inner, "secret_file": format!("{SECRET_DIR}/{}", secret::KEY), "role": role.as_str() }),
    );
    Some(serde_json::Value::Object(outer).to_string())
}

/// Turns `c` into a verifying vLLM `role` container: its `--kv-transfer-config` wrapped, the
/// package on PYTHONPATH (before the user's own), the handoff secret mounted.
pub fn install(d: &InferenceDeployment, role: Role, c: &mut Container, volumes: &mut Vec<Volume>) {
    for argv in [&mut c.command, &mut c.args].into_iter().flatten() {
        if let Some((at, inline)) = kv_transfer_config(argv) {
            let value = if inline { argv[at].split_once('=').map(|(_, v)| v.to_string()).unwrap_or_default() } else { argv[at].clone() };
            if let Some(wrapped) = wrap(&value, role) {
                argv[at] = if inline { format!("{}={wrapped}", crate::engines::vllm::KV_TRANSFER_CONFIG) } else { wrapped };
            }
        }
    }
    let env = c.env.get_or_insert_with(Vec::new);
    match env.iter_mut().find(|e| e.name == "PYTHONPATH") {
        Some(e) => e.value = Some(format!("{PYTHON_DIR}:{}", e.value.as_deref().unwrap_or_default())),
        None => env.push(EnvVar { name: "PYTHONPATH".into(), value: Some(PYTHON_DIR.into()), ..Default::default() }),
    }
    let (secret_volume, secret_mount, _) = handoff_secret(d);
    let package =
        Volume { name: VOLUME.into(), config_map: Some(ConfigMapVolumeSource { name: config_map_name(d), ..Default::default() }), ..Default::default() };
    let mounts = c.volume_mounts.get_or_insert_with(Vec::new);
    mounts.push(VolumeMount { name: VOLUME.into(), mount_path: format!("{PYTHON_DIR}/kvgate_vllm"), read_only: Some(true), ..Default::default() });
    mounts.push(secret_mount);
    volumes.extend([package, secret_volume]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extra(wrapped: &str) -> serde_json::Value {
        serde_json::from_str::<serde_json::Value>(wrapped).unwrap()
    }

    #[test]
    fn the_users_connector_becomes_the_inner_one() {
        let user = r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_device":"cpu","kv_connector_extra_config":{"kv_lease_duration":120}}"#;
        let got = extra(&wrap(user, Role::Decode).unwrap());
        assert_eq!(
            got,
            serde_json::json!({
                "kv_connector": "KvgateConnector",
                "kv_connector_module_path": "kvgate_vllm.connector",
                "kv_role": "kv_consumer",
                "kv_buffer_device": "cpu",
                "kv_load_failure_policy": "fail",
                "kv_connector_extra_config": {
                    "inner": { "kv_connector": "NixlConnector", "kv_connector_extra_config": { "kv_lease_duration": 120 } },
                    "secret_file": "/var/run/kvgate/handoff/secret",
                    "role": "decode",
                },
            })
        );
        // The user's policy stands; a connector loaded from the user's own module stays inner.
        let own = r#"{"kv_connector":"Mine","kv_connector_module_path":"my.mod","kv_role":"kv_producer","kv_load_failure_policy":"recompute"}"#;
        let got = extra(&wrap(own, Role::Prefill).unwrap());
        assert_eq!(got["kv_load_failure_policy"], "recompute");
        assert_eq!(got["kv_connector_extra_config"]["inner"], serde_json::json!({ "kv_connector": "Mine", "kv_connector_module_path": "my.mod" }));
        // Not an object, or already kvgate's: left for vLLM to judge.
        assert_eq!(wrap("NixlConnector", Role::Decode), None);
        assert_eq!(wrap(r#"{"kv_connector":"KvgateConnector"}"#, Role::Decode), None);
    }

    #[test]
    fn the_package_is_every_file_of_engines_vllm() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../engines/vllm/kvgate_vllm");
        let mut on_disk: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).filter(|f| f.ends_with(".py")).collect();
        on_disk.sort();
        assert_eq!(on_disk, FILES.map(|(f, _)| f.to_string()), "engines/vllm/kvgate_vllm gained or lost a file: list it in FILES");
    }
}
