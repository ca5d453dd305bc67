//! A container's environment and arguments as the kubelet would build them: literal values,
//! downward-API fields, values of Secret keys, and `$(VAR)` expansion in command and args.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod, Secret};
use kube::api::Api;

/// The values of the Secret keys the pod's env names, by (Secret, key).
pub type SecretValues = BTreeMap<(String, String), String>;

/// Reads every Secret key the pod's containers take env from; the kubelet's message when a
/// Secret or key it needs is missing (not optional), so the pod waits and retries as on a node.
pub async fn secret_values(client: &kube::Client, pod: &Pod) -> Result<SecretValues, String> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let mut out = SecretValues::new();
    let refs = pod.spec.iter().flat_map(|s| &s.containers).flat_map(|c| c.env.iter().flatten());
    for r in refs.filter_map(|v| v.value_from.as_ref()?.secret_key_ref.as_ref()) {
        let got = Api::<Secret>::namespaced(client.clone(), ns).get_opt(&r.name).await.map_err(|e| format!("secret {:?}: {e}", r.name))?;
        let value = got.as_ref().and_then(|s| s.data.as_ref()?.get(&r.key));
        match (got.is_some(), value) {
            (_, Some(v)) => {
                out.insert((r.name.clone(), r.key.clone()), String::from_utf8_lossy(&v.0).into_owned());
            }
            _ if r.optional == Some(true) => {}
            (false, None) => return Err(format!("secret {:?} not found", r.name)),
            (true, None) => return Err(format!("couldn't find key {} in Secret {ns}/{}", r.key, r.name)),
        }
    }
    Ok(out)
}

/// Values of the downward-API field paths the node agent supports.
pub fn field(pod: &Pod, path: &str, pod_ip: &str, host_ip: &str) -> Option<String> {
    let m = &pod.metadata;
    let spec = pod.spec.as_ref();
    Some(match path {
        "metadata.name" => m.name.clone()?,
        "metadata.namespace" => m.namespace.clone()?,
        "metadata.uid" => m.uid.clone()?,
        "spec.nodeName" => spec?.node_name.clone()?,
        "spec.serviceAccountName" => spec?.service_account_name.clone().unwrap_or_else(|| "default".into()),
        "status.podIP" => pod_ip.to_string(),
        "status.hostIP" => host_ip.to_string(),
        _ => return None,
    })
}

/// The container's environment, in order, with Secret keys from `secrets`; unsupported sources
/// are reported.
pub fn build(pod: &Pod, c: &Container, pod_ip: &str, host_ip: &str, secrets: &SecretValues) -> Result<BTreeMap<String, String>, String> {
    let mut env = BTreeMap::new();
    for var in c.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (Some(v), _) => expand(v, &env),
            (None, Some(from)) => match (&from.field_ref, &from.secret_key_ref) {
                (Some(f), _) => {
                    field(pod, &f.field_path, pod_ip, host_ip).ok_or_else(|| format!("env {}: field {} is not supported", var.name, f.field_path))?
                }
                (None, Some(s)) => match secrets.get(&(s.name.clone(), s.key.clone())) {
                    Some(v) => v.clone(),
                    None if s.optional == Some(true) => continue,
                    None => return Err(format!("env {}: secret {:?} key {} not read", var.name, s.name, s.key)),
                },
                (None, None) => return Err(format!("env {}: only value, fieldRef and secretKeyRef are supported", var.name)),
            },
            (None, None) => String::new(),
        };
        env.insert(var.name.clone(), value);
    }
    Ok(env)
}

/// `$(VAR)` becomes the variable's value; `$$(VAR)` stays literal; unknown ones stay as they are.
pub fn expand(s: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("$(") {
        if i > 0 && rest.as_bytes()[i - 1] == b'$' {
            out.push_str(&rest[..i - 1]);
            out.push_str("$(");
            rest = &rest[i + 2..];
            continue;
        }
        out.push_str(&rest[..i]);
        match rest[i + 2..].find(')') {
            Some(j) => {
                let name = &rest[i + 2..i + 2 + j];
                match env.get(name) {
                    Some(v) => out.push_str(v),
                    None => out.push_str(&rest[i..i + 3 + j]),
                }
                rest = &rest[i + 3 + j..];
            }
            None => {
                out.push_str(&rest[i..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_expand_like_the_kubelet() {
        let env: BTreeMap<String, String> = [("POD_IP".to_string(), "127.0.0.7".to_string())].into();
        assert_eq!(expand("--listen=$(POD_IP):8080", &env), "--listen=127.0.0.7:8080");
        assert_eq!(expand("$$(POD_IP)", &env), "$(POD_IP)");
        assert_eq!(expand("$(NOPE) x", &env), "$(NOPE) x");
    }

    #[test]
    fn secret_keys_are_taken_from_what_was_read_and_a_missing_one_is_a_config_error() {
        let c: Container = serde_json::from_value(serde_json::json!({ "name": "c", "env": [
            { "name": "HF_TOKEN", "valueFrom": { "secretKeyRef": { "name": "hub", "key": "token" } } },
            { "name": "OPT", "valueFrom": { "secretKeyRef": { "name": "gone", "key": "k", "optional": true } } },
            { "name": "URL", "value": "t=$(HF_TOKEN)" },
        ]}))
        .unwrap();
        let read: SecretValues = [(("hub".to_string(), "token".to_string()), "s3cret".to_string())].into();
        let env = build(&Pod::default(), &c, "", "", &read).unwrap();
        assert_eq!(env.get("HF_TOKEN").map(String::as_str), Some("s3cret"));
        assert_eq!(env.get("URL").map(String::as_str), Some("t=s3cret"));
        assert!(!env.contains_key("OPT"), "an optional missing key is left out");
        let err = build(&Pod::default(), &c, "", "", &SecretValues::new()).unwrap_err();
        assert!(err.contains("HF_TOKEN") && err.contains("hub"), "{err}");
    }
}
