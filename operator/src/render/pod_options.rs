//! What the platform adds to a role's pods (`spec.<role>.podMetadata`, `imagePullSecrets`,
//! `serviceAccountName`, `priorityClassName`, `runtimeClassName`, `volumes`, `volumeMounts`),
//! laid over what the operator rendered. The operator's own labels win over the spec's (the CRD
//! also refuses their prefixes), and a mount at a scratch directory of ours (/tmp, /dev/shm)
//! replaces our volume there: a platform that wants a bigger /tmp gets one without a duplicate
//! mount path the API server would refuse.

use k8s_openapi::api::core::v1::PodTemplateSpec;

use crate::crd::PodOptions;

/// Volumes the operator adds only as scratch space; a mount of the spec's at the same path wins.
const SCRATCH: [&str; 2] = ["tmp", "dshm"];

/// `template` with `o` laid over it; its first container is the role's.
pub fn apply(mut template: PodTemplateSpec, o: &PodOptions) -> PodTemplateSpec {
    if let Some(m) = &o.pod_metadata {
        let meta = template.metadata.get_or_insert_with(Default::default);
        for (ours, given) in [(&mut meta.labels, &m.labels), (&mut meta.annotations, &m.annotations)] {
            if let Some(given) = given {
                let mut all = given.clone();
                all.extend(ours.take().unwrap_or_default());
                *ours = Some(all);
            }
        }
    }
    let Some(spec) = template.spec.as_mut() else { return template };
    if o.image_pull_secrets.is_some() {
        spec.image_pull_secrets.clone_from(&o.image_pull_secrets);
    }
    if o.service_account_name.is_some() {
        spec.service_account_name.clone_from(&o.service_account_name);
    }
    if o.priority_class_name.is_some() {
        spec.priority_class_name.clone_from(&o.priority_class_name);
    }
    if o.runtime_class_name.is_some() {
        spec.runtime_class_name.clone_from(&o.runtime_class_name);
    }
    if let Some(given) = o.volume_mounts.as_deref().filter(|m| !m.is_empty())
        && let Some(c) = spec.containers.first_mut()
    {
        let mounts = c.volume_mounts.get_or_insert_with(Vec::new);
        let replaced: Vec<String> = mounts
            .iter()
            .filter(|m| SCRATCH.contains(&m.name.as_str()) && given.iter().any(|g| g.mount_path == m.mount_path))
            .map(|m| m.name.clone())
            .collect();
        mounts.retain(|m| !replaced.contains(&m.name));
        mounts.extend(given.iter().cloned());
        if let Some(volumes) = spec.volumes.as_mut() {
            volumes.retain(|v| !replaced.contains(&v.name));
        }
    }
    if let Some(given) = o.volumes.as_deref().filter(|v| !v.is_empty()) {
        spec.volumes.get_or_insert_with(Vec::new).extend(given.iter().cloned());
    }
    template
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, EmptyDirVolumeSource, PodSpec, Volume, VolumeMount};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use serde_json::json;

    fn rendered() -> PodTemplateSpec {
        let mount = |name: &str, path: &str| VolumeMount { name: name.into(), mount_path: path.into(), ..Default::default() };
        let volume = |name: &str| Volume { name: name.into(), empty_dir: Some(EmptyDirVolumeSource::default()), ..Default::default() };
        PodTemplateSpec {
            metadata: Some(ObjectMeta { labels: Some([("app.kubernetes.io/instance".to_string(), "llm".to_string())].into()), ..Default::default() }),
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "worker".into(),
                    volume_mounts: Some(vec![mount("model", "/models"), mount("tmp", "/tmp")]),
                    ..Default::default()
                }],
                volumes: Some(vec![volume("model"), volume("tmp")]),
                service_account_name: Some("llm-router".into()),
                ..Default::default()
            }),
        }
    }

    fn options(v: serde_json::Value) -> PodOptions {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn nothing_set_changes_nothing() {
        assert_eq!(apply(rendered(), &PodOptions::default()), rendered());
    }

    #[test]
    fn every_field_lands_in_the_pod_and_the_operators_labels_win() {
        let o = options(json!({
            "podMetadata": { "labels": { "team": "search", "app.kubernetes.io/instance": "theirs" }, "annotations": { "mesh/inject": "false" } },
            "imagePullSecrets": [{ "name": "registry" }],
            "serviceAccountName": "model-reader", "priorityClassName": "serving", "runtimeClassName": "nvidia",
            "volumes": [{ "name": "cache", "emptyDir": {} }],
            "volumeMounts": [{ "name": "cache", "mountPath": "/cache" }],
        }));
        let t = apply(rendered(), &o);
        let meta = t.metadata.unwrap();
        let labels = meta.labels.unwrap();
        assert_eq!((labels["team"].as_str(), labels["app.kubernetes.io/instance"].as_str()), ("search", "llm"));
        assert_eq!(meta.annotations.unwrap()["mesh/inject"], "false");
        let spec = t.spec.unwrap();
        assert_eq!(spec.image_pull_secrets.unwrap()[0].name, "registry");
        assert_eq!(
            (spec.service_account_name.as_deref(), spec.priority_class_name.as_deref(), spec.runtime_class_name.as_deref()),
            (Some("model-reader"), Some("serving"), Some("nvidia"))
        );
        let volumes: Vec<_> = spec.volumes.unwrap().into_iter().map(|v| v.name).collect();
        assert_eq!(volumes, ["model", "tmp", "cache"]);
        let mounts: Vec<_> = spec.containers[0].volume_mounts.clone().unwrap().into_iter().map(|m| m.mount_path).collect();
        assert_eq!(mounts, ["/models", "/tmp", "/cache"]);
    }

    /// Every role of kvgate and of a disaggregated engine renders its own options.
    #[test]
    fn every_role_of_every_engine_carries_its_own() {
        use crate::crd::InferenceDeployment;
        use crate::gate::Role;
        use crate::render::workers::Telemetry;
        let own = |sa: &str| json!({ "serviceAccountName": sa, "volumes": [{ "name": "cache", "emptyDir": {} }], "volumeMounts": [{ "name": "cache", "mountPath": "/cache" }] });
        let with = |role: serde_json::Value, sa: &str| {
            let mut r = role;
            r.as_object_mut().unwrap().extend(own(sa).as_object().unwrap().clone());
            r
        };
        let pod = |dep: k8s_openapi::api::apps::v1::Deployment| dep.spec.template.spec.unwrap();
        let sa_and_mount =
            |p: PodSpec| (p.service_account_name.unwrap(), p.containers[0].volume_mounts.clone().unwrap().iter().any(|m| m.mount_path == "/cache"));
        let telemetry = Telemetry::logging(kvgate_telemetry::LogFormat::Json);
        let kvgate = InferenceDeployment::for_test(json!({
            "model": { "name": "tiny" }, "contextWindow": 64,
            "prefill": with(json!({ "kvPool": {} }), "p"), "decode": with(json!({ "kvPool": {} }), "d"),
            "router": { "priorityClassName": "serving" },
        }));
        for (role, sa) in [(Role::Prefill, "p"), (Role::Decode, "d")] {
            assert_eq!(sa_and_mount(pod(super::super::workers::deployment(&kvgate, role, "abc", "img", 1, &telemetry))), (sa.to_string(), true));
        }
        let router = pod(super::super::router::deployment(&kvgate, "img", 64, &telemetry));
        assert_eq!((router.service_account_name.as_deref(), router.priority_class_name.as_deref()), (Some("llm-router"), Some("serving")));
        let container = |name: &str| json!({ "name": name, "image": "vllm" });
        let vllm = InferenceDeployment::for_test(json!({
            "engine": "vllm", "contextWindow": 64, "model": { "hub": "org/model" },
            "prefill": with(json!({ "container": container("p") }), "p"), "decode": with(json!({ "container": container("d") }), "d"),
            "router": with(json!({ "container": container("r") }), "r"),
        }));
        for (role, sa) in [(Role::Prefill, "p"), (Role::Decode, "d"), (Role::Router, "r")] {
            assert_eq!(sa_and_mount(pod(super::super::engine::deployment(&vllm, role, "abc", 1))), (sa.to_string(), true), "{role:?}");
        }
    }

    #[test]
    fn a_mount_at_a_scratch_directory_replaces_ours_and_only_scratch() {
        let o = options(json!({
            "volumes": [{ "name": "big-tmp", "emptyDir": { "sizeLimit": "20Gi" } }],
            "volumeMounts": [{ "name": "big-tmp", "mountPath": "/tmp" }],
        }));
        let spec = apply(rendered(), &o).spec.unwrap();
        let volumes: Vec<_> = spec.volumes.unwrap().into_iter().map(|v| v.name).collect();
        assert_eq!(volumes, ["model", "big-tmp"]);
        let mounts: Vec<_> = spec.containers[0].volume_mounts.clone().unwrap().into_iter().map(|m| (m.name, m.mount_path)).collect();
        assert_eq!(mounts, [("model".to_string(), "/models".to_string()), ("big-tmp".to_string(), "/tmp".to_string())]);
    }
}
