//! Which node directories an InferenceDeployment may mount. A `hostPath` volume (the model's, or
//! one a role adds in `volumes`) turns "may create an InferenceDeployment" into "may read the
//! node" (the operator creates the pods, a confused deputy), so it is refused unless the operator
//! was started with an allowlist of directory prefixes (`--allowed-host-paths`, chart value
//! `allowedHostPaths`).

use std::path::{Component, Path};

use crate::crd::InferenceDeployment;

/// Why a host path of the spec may not be mounted, if one may not: the first one outside the
/// allowlist, named by its field.
pub fn refusal(d: &InferenceDeployment, allowed: &[String]) -> Option<String> {
    let model = d.spec.model.volume.as_ref().and_then(|v| v.host_path.as_deref()).map(|p| ("spec.model.volume.hostPath".to_string(), p));
    let roles = d.spec.pod_options().flat_map(|(role, o)| {
        o.volumes.iter().flatten().filter_map(move |v| Some((format!("{role}.volumes[{}].hostPath", v.name), v.host_path.as_ref()?.path.as_str())))
    });
    let (field, path) = model.into_iter().chain(roles).find(|(_, path)| !allowed.iter().any(|prefix| is_within(path, prefix)))?;
    let setting = if allowed.is_empty() {
        "the operator allows no host paths (--allowed-host-paths / chart value allowedHostPaths is empty)".to_string()
    } else {
        format!("it is not under any of --allowed-host-paths {allowed:?}")
    };
    Some(format!("{field} {path:?} may not be mounted: {setting}; use a persistentVolumeClaim, or have the operator's administrator allow the directory"))
}

/// `path` is `prefix` or below it, compared component by component on normalized absolute paths
/// (so `/models-evil` is not under `/models`, and `/models/../etc` is refused outright).
fn is_within(path: &str, prefix: &str) -> bool {
    let clean = |p: &str| -> Option<Vec<String>> {
        let p = Path::new(p);
        if !p.is_absolute() {
            return None;
        }
        p.components()
            .filter(|c| !matches!(c, Component::RootDir | Component::CurDir))
            .map(|c| match c {
                Component::Normal(s) => s.to_str().map(str::to_string),
                _ => None, // `..` and prefixes are never allowed
            })
            .collect()
    };
    match (clean(path), clean(prefix)) {
        (Some(p), Some(pre)) => p.starts_with(&pre),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(host_path: Option<&str>) -> InferenceDeployment {
        let mut spec = serde_json::json!({
            "model": { "name": "tiny" }, "contextWindow": 1024,
            "prefill": { "kvPool": { "tokens": 4096 } }, "decode": { "kvPool": { "tokens": 4096 } },
        });
        if let Some(p) = host_path {
            spec["model"] = serde_json::json!({ "path": "llama", "volume": { "hostPath": p } });
        }
        InferenceDeployment::for_test(spec)
    }

    #[test]
    fn without_an_allowlist_every_host_path_is_refused_naming_the_path_and_the_setting() {
        let why = refusal(&d(Some("/")), &[]).unwrap();
        assert!(why.contains("\"/\"") && why.contains("--allowed-host-paths") && why.contains("allowedHostPaths"), "{why}");
        assert_eq!(refusal(&d(None), &[]), None, "a built-in model mounts nothing");
    }

    #[test]
    fn only_directories_under_an_allowed_prefix_pass() {
        let allowed = vec!["/srv/models".to_string()];
        assert_eq!(refusal(&d(Some("/srv/models")), &allowed), None);
        assert_eq!(refusal(&d(Some("/srv/models/llama/")), &allowed), None);
        for bad in ["/srv/models-evil", "/srv", "/var/lib/kubelet/pods", "/srv/models/../../etc", "srv/models"] {
            assert!(refusal(&d(Some(bad)), &allowed).is_some(), "{bad}");
        }
    }

    #[test]
    fn a_roles_own_host_path_volume_is_held_to_the_same_allowlist_and_named_by_its_field() {
        let mut spec = serde_json::to_value(&d(None).spec).unwrap();
        spec["decode"]["volumes"] = serde_json::json!([{ "name": "scratch", "emptyDir": {} }, { "name": "cache", "hostPath": { "path": "/srv/cache" } }]);
        let d = InferenceDeployment::for_test(spec);
        let why = refusal(&d, &["/srv/models".to_string()]).expect("refused");
        assert!(why.starts_with("spec.decode.volumes[cache].hostPath \"/srv/cache\""), "{why}");
        assert_eq!(refusal(&d, &["/srv".to_string()]), None);
    }
}
