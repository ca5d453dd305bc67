//! A container's environment and arguments as the kubelet would build them: literal values,
//! downward-API fields, and `$(VAR)` expansion in command and args.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod};

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

/// The container's environment, in order; unsupported sources are reported.
pub fn build(pod: &Pod, c: &Container, pod_ip: &str, host_ip: &str) -> Result<BTreeMap<String, String>, String> {
    let mut env = BTreeMap::new();
    for var in c.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (Some(v), _) => expand(v, &env),
            (None, Some(from)) => match &from.field_ref {
                Some(f) => field(pod, &f.field_path, pod_ip, host_ip).ok_or_else(|| format!("env {}: field {} is not supported", var.name, f.field_path))?,
                None => return Err(format!("env {}: only value and fieldRef are supported", var.name)),
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
}
