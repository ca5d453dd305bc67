//! An external engine's pods (llama.cpp, vLLM, SGLang): one Deployment per role and revision
//! running the user's container behind the same readiness gate as kvgate's workers, and the
//! deployment's Service in front of every revision's serving pods (only verified ones are
//! ready). A disaggregated engine (prefill, decode and router) also gets one headless Service
//! per revision for prefill and for decode: its router reaches only its own revision's pods.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    Capabilities, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource, SecurityContext, Service, ServicePort, ServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::workers::{deployment_name, gated, http_probe, model_flag};
use super::{MODEL_DIR, name, owned_meta};
use crate::crd::InferenceDeployment;
use crate::gate::Role;
use crate::labels;

/// The Deployment of the engine's `role` pods at one revision, with `replicas` pods.
pub fn deployment(d: &InferenceDeployment, role: Role, revision: &str, replicas: i32) -> Deployment {
    let spec = d.spec.external(role);
    let mut c = spec.map(|s| s.container.clone()).unwrap_or_default();
    if c.name.is_empty() {
        c.name = "engine".into();
    }
    // The gate and the Service reach the engine on a port named `http`.
    let port = i32::from(d.spec.port(role));
    let ports = c.ports.get_or_insert_with(Vec::new);
    if !ports.iter().any(|p| p.name.as_deref() == Some("http")) {
        match ports.iter_mut().find(|p| p.container_port == port) {
            Some(p) => p.name = Some("http".into()),
            None => ports.push(ContainerPort { name: Some("http".into()), container_port: port, ..Default::default() }),
        }
    }
    // Ready only once it answers its health endpoint (and, through the gate, once verified).
    c.readiness_probe.get_or_insert_with(|| http_probe(d.spec.engine().health_path(), 2));
    // The restricted profile, unless the container sets its own; engines write caches next to
    // their binaries, so their root filesystem stays writable.
    c.security_context.get_or_insert_with(|| SecurityContext {
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities { drop: Some(vec!["ALL".into()]), ..Default::default() }),
        ..Default::default()
    });
    // The model, and every role of a disaggregated revision knows where the others of its
    // revision are: set before the user's own env, so `$(KVGATE_MODEL)` and
    // `$(KVGATE_PREFILL_HOST)` expand in its args.
    let (model, model_volume) = model_flag(d);
    let mut env = model_env(d, model);
    if role != Role::Server {
        env.extend(peers(d, revision));
    }
    env.extend(c.env.take().unwrap_or_default());
    c.env = Some(env);
    let mut volumes: Vec<Volume> = model_volume.into_iter().collect();
    let mounts = c.volume_mounts.get_or_insert_with(Vec::new);
    mounts.extend(volumes.iter().map(|v| VolumeMount { name: v.name.clone(), mount_path: MODEL_DIR.into(), read_only: Some(true), ..Default::default() }));
    let mut scratch = |name: &str, path: &str, source: EmptyDirVolumeSource| {
        if !mounts.iter().any(|m| m.mount_path == path) {
            volumes.push(Volume { name: name.into(), empty_dir: Some(source), ..Default::default() });
            mounts.push(VolumeMount { name: name.into(), mount_path: path.into(), ..Default::default() });
        }
    };
    scratch("tmp", "/tmp", EmptyDirVolumeSource { size_limit: Some(Quantity("1Gi".into())), ..Default::default() });
    // vLLM and SGLang pass tensors between their processes in shared memory, more than a
    // container's default 64 MiB /dev/shm holds (vLLM: "Increase /dev/shm").
    if d.spec.engine().shared_memory() && role != Role::Router {
        scratch("dshm", "/dev/shm", EmptyDirVolumeSource { medium: Some("Memory".into()), ..Default::default() });
    }
    if d.spec.engine().verifies_handoff(&d.spec, role) {
        super::vllm_connector::install(d, role, &mut c, &mut volumes);
    }
    let (placement, options) = spec.map(|s| (s.placement.clone(), s.pod.clone())).unwrap_or_default();
    gated(d, role, revision, replicas, c, volumes, (&placement, &options))
}

/// `KVGATE_MODEL` (`/models/<path>`, or the hub name) and, with spec.model.tokenSecret, the
/// hub's token as `HF_TOKEN` (read by vLLM, SGLang and llama.cpp alike), from the Secret: the
/// operator never reads it.
fn model_env(d: &InferenceDeployment, model: String) -> Vec<EnvVar> {
    let token = d.spec.model.token_secret.clone().map(|secret| EnvVar {
        name: "HF_TOKEN".into(),
        value_from: Some(EnvVarSource { secret_key_ref: Some(secret), ..Default::default() }),
        ..Default::default()
    });
    std::iter::once(EnvVar { name: "KVGATE_MODEL".into(), value: Some(model), ..Default::default() }).chain(token).collect()
}

/// `KVGATE_PREFILL_HOST`/`_PORT` and `KVGATE_DECODE_HOST`/`_PORT`: the revision's headless
/// Services, by DNS name within the namespace.
fn peers(d: &InferenceDeployment, revision: &str) -> Vec<EnvVar> {
    let ns = d.metadata.namespace.as_deref().unwrap_or("default");
    let var = |name: String, value: String| EnvVar { name, value: Some(value), ..Default::default() };
    [Role::Prefill, Role::Decode]
        .into_iter()
        .flat_map(|role| {
            let upper = role.as_str().to_uppercase();
            [
                var(format!("KVGATE_{upper}_HOST"), format!("{}.{ns}.svc", deployment_name(d, role, revision))),
                var(format!("KVGATE_{upper}_PORT"), d.spec.port(role).to_string()),
            ]
        })
        .collect()
}

/// The headless Service of a disaggregated revision's prefill or decode pods, named like their
/// Deployment. Not-ready pods are published: the router of a candidate revision carries the
/// integrity canary's questions before any of them takes traffic.
pub fn revision_service(d: &InferenceDeployment, role: Role, revision: &str) -> Service {
    let n = name(d);
    let selector = labels::revision_selector(n, role.as_str(), revision);
    Service {
        metadata: owned_meta(d, deployment_name(d, role, revision), labels::with(labels::common(n), selector.clone())),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            publish_not_ready_addresses: Some(true),
            selector: Some(selector),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: d.spec.port(role).into(),
                target_port: Some(IntOrString::String("http".into())),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The deployment's API: `<name>` port 80 -> the verified pods of the role that serves it (the
/// engine's servers, or a disaggregated engine's routers), every revision.
pub fn api_service(d: &InferenceDeployment) -> Service {
    super::api_service(d, d.spec.engine().api_role(&d.spec).as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(server: serde_json::Value) -> InferenceDeployment {
        engine_d("llamacpp", server)
    }

    fn engine_d(engine: &str, server: serde_json::Value) -> InferenceDeployment {
        let spec = serde_json::json!({
            "engine": engine, "contextWindow": 4096,
            "model": { "path": "tiny.gguf", "volume": { "persistentVolumeClaim": "models" } },
            "server": server,
        });
        InferenceDeployment::for_test(spec)
    }

    #[test]
    fn the_users_container_gets_the_gate_a_named_port_the_model_and_a_health_probe() {
        let dep = deployment(
            &d(serde_json::json!({ "replicas": 2, "container": { "name": "llama", "image": "llama:1", "args": ["-c", "4096", "-np", "4"] } })),
            Role::Server,
            "abc",
            2,
        );
        assert_eq!(dep.metadata.name.as_deref(), Some("llm-server-abc"));
        let pod = dep.spec.template.spec.unwrap();
        assert_eq!(pod.readiness_gates.unwrap()[0].condition_type, crate::gate::CONDITION);
        assert_eq!(pod.automount_service_account_token, Some(false));
        let c = &pod.containers[0];
        assert_eq!(c.args.as_deref().unwrap(), ["-c", "4096", "-np", "4"], "the engine's own flags, untouched");
        assert_eq!(c.ports.as_ref().unwrap()[0].name.as_deref(), Some("http"));
        assert_eq!(c.ports.as_ref().unwrap()[0].container_port, 8080, "llama.cpp's default port");
        assert_eq!(c.readiness_probe.as_ref().unwrap().http_get.as_ref().unwrap().path.as_deref(), Some("/health"));
        let mounts: Vec<_> = c.volume_mounts.as_ref().unwrap().iter().map(|m| m.mount_path.as_str()).collect();
        assert_eq!(mounts, ["/models", "/tmp"]);
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!((sc.allow_privilege_escalation, sc.read_only_root_filesystem), (Some(false), None));
        assert_eq!(pod.security_context.unwrap().run_as_non_root, Some(true));
        assert_eq!(pod.containers[0].image.as_deref(), Some("llama:1"));
    }

    #[test]
    fn what_the_user_set_is_kept() {
        let server = serde_json::json!({ "port": 9000, "container": {
            "name": "vllm", "image": "vllm:1", "ports": [{ "containerPort": 9000 }],
            "readinessProbe": { "httpGet": { "path": "/ready", "port": 9000 } },
            "securityContext": { "readOnlyRootFilesystem": true, "runAsUser": 1000 },
        }});
        let pod = deployment(&d(server), Role::Server, "abc", 1).spec.template.spec.unwrap();
        let c = &pod.containers[0];
        assert_eq!((c.ports.as_ref().unwrap().len(), c.ports.as_ref().unwrap()[0].name.as_deref()), (1, Some("http")), "its port named, not added");
        assert_eq!(c.readiness_probe.as_ref().unwrap().http_get.as_ref().unwrap().path.as_deref(), Some("/ready"));
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!((sc.read_only_root_filesystem, sc.run_as_user), (Some(true), Some(1000)));
        let mounts: Vec<_> = c.volume_mounts.as_ref().unwrap().iter().map(|m| m.mount_path.as_str()).collect();
        assert_eq!(mounts, ["/models", "/tmp"], "llama.cpp needs no shared memory");
        assert_eq!(
            api_service(&d(serde_json::json!({ "container": { "name": "x" } }))).spec.unwrap().selector.unwrap()["app.kubernetes.io/component"],
            "server"
        );
    }

    #[test]
    fn a_hub_model_needs_no_volume_and_its_token_comes_from_the_secret() {
        let mut spec =
            serde_json::to_value(&d(serde_json::json!({ "container": { "name": "vllm", "image": "v", "env": [{ "name": "X", "value": "1" }] } })).spec)
                .unwrap();
        spec["model"] = serde_json::json!({ "hub": "meta-llama/Llama-3.1-8B-Instruct", "tokenSecret": { "name": "hf", "key": "token" } });
        let pod = deployment(&InferenceDeployment::for_test(spec), Role::Server, "abc", 1).spec.template.spec.unwrap();
        assert!(pod.volumes.unwrap().iter().all(|v| v.name != "model"));
        let env = pod.containers[0].env.clone().unwrap();
        let names: Vec<_> = env.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["KVGATE_MODEL", "HF_TOKEN", "X"], "ours first, so the user's args and env can use them");
        assert_eq!(env[0].value.as_deref(), Some("meta-llama/Llama-3.1-8B-Instruct"));
        let secret = env[1].value_from.as_ref().unwrap().secret_key_ref.as_ref().unwrap();
        assert_eq!((secret.name.as_str(), secret.key.as_str(), env[1].value.as_ref()), ("hf", "token", None));
        // A model on a volume is named by its path there.
        let pod = deployment(&d(serde_json::json!({ "container": { "name": "l" } })), Role::Server, "abc", 1).spec.template.spec.unwrap();
        assert_eq!(pod.containers[0].env.as_ref().unwrap()[0].value.as_deref(), Some("/models/tiny.gguf"));
    }

    #[test]
    fn vllm_gets_shared_memory_beyond_a_containers_64_mib() {
        let pod = deployment(&engine_d("vllm", serde_json::json!({ "container": { "name": "vllm", "image": "v" } })), Role::Server, "abc", 1)
            .spec
            .template
            .spec
            .unwrap();
        let shm = pod.volumes.unwrap().into_iter().find(|v| v.name == "dshm").expect("a /dev/shm volume");
        assert_eq!(shm.empty_dir.unwrap().medium.as_deref(), Some("Memory"));
        assert_eq!(pod.containers[0].ports.as_ref().unwrap()[0].container_port, 8000, "vLLM's default port");
        assert!(pod.containers[0].volume_mounts.as_ref().unwrap().iter().any(|m| m.mount_path == "/dev/shm"));
    }

    /// examples/vllm-pd.yaml as shipped: prefill and decode run kvgate's connector around
    /// NixlConnector, with the package and the handoff secret mounted; the router is untouched.
    #[test]
    fn a_disaggregated_vllm_verifies_its_handoffs_unless_told_not_to() {
        let example: serde_json::Value = serde_yaml::from_str(include_str!("../../../examples/vllm-pd.yaml")).unwrap();
        let d = InferenceDeployment::for_test(example["spec"].clone());
        assert!(d.spec.handoff_secret());
        for role in [Role::Prefill, Role::Decode] {
            let pod = deployment(&d, role, "abc", 1).spec.template.spec.unwrap();
            let c = &pod.containers[0];
            let args = c.args.as_deref().unwrap();
            let at = args.iter().position(|a| a == "--kv-transfer-config").unwrap();
            let config: serde_json::Value = serde_json::from_str(&args[at + 1]).unwrap();
            assert_eq!(config["kv_connector"], "KvgateConnector");
            assert_eq!(config["kv_connector_extra_config"]["inner"]["kv_connector"], "NixlConnector");
            assert_eq!(config["kv_connector_extra_config"]["role"], role.as_str());
            assert_eq!(config["kv_role"], if role == Role::Prefill { "kv_producer" } else { "kv_consumer" });
            let env = c.env.as_ref().unwrap();
            assert!(env.iter().any(|e| e.name == "PYTHONPATH" && e.value.as_deref() == Some("/opt/kvgate/python")));
            let mounts: Vec<_> = c.volume_mounts.as_ref().unwrap().iter().map(|m| m.mount_path.as_str()).collect();
            assert!(mounts.contains(&"/opt/kvgate/python/kvgate_vllm") && mounts.contains(&"/var/run/kvgate/handoff"), "{mounts:?}");
            let volumes = pod.volumes.unwrap();
            let package = volumes.iter().find_map(|v| v.config_map.as_ref()).unwrap();
            assert_eq!(package.name, crate::render::vllm_connector::config_map_name(&d));
            assert!(volumes.iter().any(|v| v.secret.as_ref().is_some_and(|s| s.secret_name == Some(crate::render::secret::secret_name(&d)))));
        }
        let router = deployment(&d, Role::Router, "abc", 1).spec.template.spec.unwrap();
        assert!(router.volumes.unwrap().iter().all(|v| v.config_map.is_none() && v.secret.is_none()));
        // verifyHandoff: false (on both: the CRD holds them equal) leaves the connector as the
        // user wrote it, and the deployment without a handoff Secret.
        let mut spec = example["spec"].clone();
        spec["prefill"]["verifyHandoff"] = false.into();
        spec["decode"]["verifyHandoff"] = false.into();
        let d = InferenceDeployment::for_test(spec);
        for role in [Role::Prefill, Role::Decode] {
            let c = deployment(&d, role, "abc", 1).spec.template.spec.unwrap().containers[0].clone();
            assert!(c.args.unwrap().iter().any(|a| a.contains("\"kv_connector\":\"NixlConnector\"")));
            assert!(c.env.unwrap().iter().all(|e| e.name != "PYTHONPATH"));
        }
        assert!(!d.spec.handoff_secret());
    }
}
