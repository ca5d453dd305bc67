//! Prefill and decode: one Deployment per role and revision, and one headless Service per role
//! through whose EndpointSlices the router finds the ready (that is: verified) pods.

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource, HTTPGetAction, HostPathVolumeSource, ObjectFieldSelector,
    PersistentVolumeClaimVolumeSource, PodReadinessGate, PodSecurityContext, PodSpec, PodTemplateSpec, Probe, SeccompProfile, SecretVolumeSource,
    SecurityContext, Service, ServicePort, ServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kvgate_proto::contract::flag;
use kvgate_telemetry::LogFormat;

use super::{KV_PORT, MODEL_DIR, SECRET_DIR, name, owned_meta, secret};
use crate::crd::InferenceDeployment;
use crate::gate::{self, Role};
use crate::labels;

pub fn deployment_name(d: &InferenceDeployment, role: Role, revision: &str) -> String {
    format!("{}-{}-{revision}", name(d), role.as_str())
}

pub fn service_name(d: &InferenceDeployment, role: Role) -> String {
    format!("{}-{}", name(d), role.as_str())
}

/// `--model` (or, for an external engine, `KVGATE_MODEL`) and the volume it needs, if any: a
/// hub name needs none, the engine downloads it.
pub fn model_flag(d: &InferenceDeployment) -> (String, Option<Volume>) {
    let m = &d.spec.model;
    if let Some(hub) = &m.hub {
        return (hub.clone(), None);
    }
    match (&m.name, &m.path, &m.volume) {
        (Some(n), _, _) => (n.clone(), None),
        (None, Some(path), Some(v)) => {
            let volume = Volume {
                name: "model".into(),
                persistent_volume_claim: v
                    .persistent_volume_claim
                    .clone()
                    .map(|claim_name| PersistentVolumeClaimVolumeSource { claim_name, read_only: Some(true) }),
                host_path: v.host_path.clone().map(|path| HostPathVolumeSource { path, type_: Some("Directory".into()) }),
                ..Default::default()
            };
            (format!("{MODEL_DIR}/{}", path.trim_start_matches('/')), Some(volume))
        }
        // The schema rejects these; `tiny` keeps a broken object harmless.
        _ => ("tiny".into(), None),
    }
}

fn env_field(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        // The API version spelled out as the API server fills it in: the selector is applied
        // whole, and the watch compares what the operator owns with what it would apply.
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector { field_path: path.into(), api_version: Some("v1".into()) }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// How the worker pods this operator renders log and trace (its `--worker-log-format` and
/// `--worker-otlp-endpoint`).
#[derive(Debug, Clone)]
pub struct Telemetry {
    pub log: LogFormat,
    /// Where the pods export spans (OTLP over HTTP); none: no export.
    pub otlp_endpoint: Option<String>,
}

impl Telemetry {
    /// Logs in `log`, no span export.
    pub fn logging(log: LogFormat) -> Telemetry {
        Telemetry { log, otlp_endpoint: None }
    }
}

fn env_value(name: &str, value: &str) -> EnvVar {
    EnvVar { name: name.into(), value: Some(value.into()), ..Default::default() }
}

/// How long a kvgate pod told to stop still accepts (its Service's endpoints and the routers'
/// peers drop it meanwhile), well within `TERMINATION_GRACE_SECONDS`.
pub const SHUTDOWN_DELAY_MS: u64 = 3000;

/// A pod's time from SIGTERM to SIGKILL: the shutdown delay, then its requests in flight.
pub const TERMINATION_GRACE_SECONDS: i64 = 10;
const _: () = assert!(SHUTDOWN_DELAY_MS * 2 < TERMINATION_GRACE_SECONDS as u64 * 1000, "the grace leaves time for requests in flight");

/// Env every worker container gets: where it runs (for its listen addresses and logs), the
/// shutdown delay and, with an OTLP endpoint, the standard OpenTelemetry variables, the pod and
/// namespace as resource attributes of its spans.
pub fn worker_env(telemetry: &Telemetry) -> Vec<EnvVar> {
    let mut env = vec![
        env_field("POD_IP", "status.podIP"),
        env_field("POD_NAME", "metadata.name"),
        env_field("POD_NAMESPACE", "metadata.namespace"),
        env_value("KVGATE_SHUTDOWN_DELAY_MS", &SHUTDOWN_DELAY_MS.to_string()),
    ];
    if let Some(endpoint) = &telemetry.otlp_endpoint {
        env.push(env_value("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint));
        env.push(env_value("OTEL_RESOURCE_ATTRIBUTES", "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)"));
    }
    env
}

/// Non-root, read-only root filesystem, no capabilities: workers need none.
pub fn restricted() -> (PodSecurityContext, SecurityContext) {
    let pod = PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(65532),
        run_as_group: Some(65532),
        // The kubelet gives this group the mounted Secret's files (mode 0400 becomes 0440, group
        // 65532): the worker reads its handoff secret as a non-root user; others cannot.
        fs_group: Some(65532),
        seccomp_profile: Some(SeccompProfile { type_: "RuntimeDefault".into(), ..Default::default() }),
        ..Default::default()
    };
    let container = SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        capabilities: Some(Capabilities { drop: Some(vec!["ALL".into()]), ..Default::default() }),
        ..Default::default()
    };
    (pod, container)
}

pub fn http_probe(path: &str, period: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction { path: Some(path.into()), port: IntOrString::String("http".into()), ..Default::default() }),
        period_seconds: Some(period),
        failure_threshold: Some(3),
        ..Default::default()
    }
}

/// The handoff Secret as every role mounts it (router, prefill and decode all sign or check
/// the deployment's internal traffic with it), and the flag that points at it.
pub fn handoff_secret(d: &InferenceDeployment) -> (Volume, VolumeMount, String) {
    let volume = Volume {
        name: "handoff-secret".into(),
        secret: Some(SecretVolumeSource { secret_name: Some(secret::secret_name(d)), default_mode: Some(0o400), ..Default::default() }),
        ..Default::default()
    };
    let mount = VolumeMount { name: "handoff-secret".into(), mount_path: SECRET_DIR.into(), read_only: Some(true), ..Default::default() };
    (volume, mount, flag::arg(flag::HANDOFF_SECRET_FILE, format!("{SECRET_DIR}/{}", secret::KEY)))
}

/// The worker container's arguments. Pods listen on every address of their own network namespace,
/// as on any cluster (so `kubectl port-forward`, which dials the pod's localhost, works); decode
/// tells prefill its pod IP for the KV port (`$(POD_IP)` is expanded by the kubelet).
pub fn worker_args(d: &InferenceDeployment, role: Role, telemetry: &Telemetry) -> Vec<String> {
    let r = d.spec.worker(role);
    let pool = r.kv_pool.clone().unwrap_or_default();
    let (model, _) = model_flag(d);
    let mut args =
        vec![role.as_str().to_string(), flag::arg(flag::LISTEN, format!("0.0.0.0:{}", d.spec.port(role))), flag::arg(flag::LOG_FORMAT, telemetry.log.as_str())];
    if role == Role::Decode {
        args.push(flag::arg(flag::KV_LISTEN, format!("0.0.0.0:{KV_PORT}")));
        args.push(flag::arg(flag::KV_ADVERTISE, format!("$(POD_IP):{KV_PORT}")));
        args.push(flag::arg(flag::HANDOFF_TIMEOUT_MS, d.spec.handoff.timeout_ms));
    }
    args.push(handoff_secret(d).2);
    args.push(flag::arg(flag::MODEL, model));
    args.push(flag::arg(flag::CONTEXT_WINDOW, d.spec.context_window));
    args.push(flag::arg(flag::PAGE_SIZE, pool.page_size));
    args.push(flag::arg(flag::KV_DTYPE, &pool.dtype));
    args.push(flag::arg(flag::DEVICE, &pool.device));
    if let Some(b) = pool.bytes {
        args.push(flag::arg(flag::KV_POOL_BYTES, b));
    }
    if let Some(t) = pool.tokens {
        args.push(flag::arg(flag::KV_POOL_TOKENS, t));
    }
    if let Some(f) = &pool.memory_fraction {
        args.push(flag::arg(flag::KV_MEMORY_FRACTION, f));
    }
    args
}

/// The Deployment of one role at one revision, with `replicas` pods.
pub fn deployment(d: &InferenceDeployment, role: Role, revision: &str, image: &str, replicas: i32, telemetry: &Telemetry) -> Deployment {
    let r = d.spec.worker(role);
    let (_, model_volume) = model_flag(d);
    let mut volumes: Vec<Volume> = model_volume.into_iter().collect();
    let mut mounts: Vec<VolumeMount> =
        volumes.iter().map(|v| VolumeMount { name: v.name.clone(), mount_path: MODEL_DIR.into(), read_only: Some(true), ..Default::default() }).collect();
    let mut ports = vec![ContainerPort { name: Some("http".into()), container_port: d.spec.port(role).into(), ..Default::default() }];
    if role == Role::Decode {
        ports.push(ContainerPort { name: Some("kv".into()), container_port: KV_PORT, ..Default::default() });
    }
    let (secret_volume, secret_mount, _) = handoff_secret(d);
    volumes.push(secret_volume);
    mounts.push(secret_mount);
    // The root filesystem is read-only; a small writable /tmp (lost with the pod, kept across
    // container restarts) is what libraries that write temporary files expect.
    volumes.push(Volume {
        name: "tmp".into(),
        empty_dir: Some(EmptyDirVolumeSource { size_limit: Some(Quantity("64Mi".into())), ..Default::default() }),
        ..Default::default()
    });
    mounts.push(VolumeMount { name: "tmp".into(), mount_path: "/tmp".into(), ..Default::default() });
    let (_, container_sc) = restricted();
    let container = Container {
        name: "worker".into(),
        image: Some(image.into()),
        args: Some(worker_args(d, role, telemetry)),
        env: Some(worker_env(telemetry)),
        ports: Some(ports),
        readiness_probe: Some(http_probe("/readyz", 2)),
        liveness_probe: Some(http_probe("/healthz", 10)),
        resources: r.resources.clone(),
        security_context: Some(container_sc),
        volume_mounts: (!mounts.is_empty()).then_some(mounts),
        ..Default::default()
    };
    gated(d, role, revision, replicas, container, volumes, (&r.placement, &r.pod))
}

/// The Deployment of `role`'s pods at one revision: `container`, non-root, no service-account
/// token (neither workers nor engines call the API server), and the readiness gate the
/// operator sets only once the pod's measured pool holds the window; placed, and with what the
/// platform adds to the role's pods, as the spec says.
pub fn gated(
    d: &InferenceDeployment,
    role: Role,
    revision: &str,
    replicas: i32,
    container: Container,
    volumes: Vec<Volume>,
    (placement, options): (&crate::crd::Placement, &crate::crd::PodOptions),
) -> Deployment {
    let n = name(d);
    let selector = labels::revision_selector(n, role.as_str(), revision);
    let pod_labels = labels::pod(labels::with(labels::common(n), selector.clone()), d.metadata.uid.as_deref());
    let (pod_sc, _) = restricted();
    Deployment {
        metadata: owned_meta(d, deployment_name(d, role, revision), labels::with(labels::common(n), selector.clone())),
        spec: DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector { match_labels: Some(selector), ..Default::default() },
            // A revision's pods are verified one by one; surge keeps the old ones until the new
            // ones are Ready (which, with the readiness gate, means verified).
            strategy: Some(DeploymentStrategy { type_: Some("RollingUpdate".into()), ..Default::default() }),
            template: super::pod_options::apply(
                PodTemplateSpec {
                    metadata: Some(ObjectMeta { labels: Some(pod_labels), ..Default::default() }),
                    spec: Some(super::placement::placed(
                        PodSpec {
                            containers: vec![container],
                            readiness_gates: Some(vec![PodReadinessGate { condition_type: gate::CONDITION.into() }]),
                            automount_service_account_token: Some(false),
                            security_context: Some(pod_sc),
                            volumes: (!volumes.is_empty()).then_some(volumes),
                            termination_grace_period_seconds: Some(TERMINATION_GRACE_SECONDS),
                            ..Default::default()
                        },
                        d,
                        placement,
                        Some(role),
                        Some(revision),
                    )),
                },
                options,
            ),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The headless Service of one role (all revisions; only Ready pods are used by the router).
pub fn service(d: &InferenceDeployment, role: Role) -> Service {
    let n = name(d);
    let mut ports = vec![ServicePort {
        name: Some("http".into()),
        port: d.spec.port(role).into(),
        target_port: Some(IntOrString::String("http".into())),
        ..Default::default()
    }];
    if role == Role::Decode {
        ports.push(ServicePort { name: Some("kv".into()), port: KV_PORT, target_port: Some(IntOrString::String("kv".into())), ..Default::default() });
    }
    Service {
        metadata: owned_meta(d, service_name(d, role), labels::with(labels::common(n), labels::role_selector(n, role.as_str()))),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(labels::role_selector(n, role.as_str())),
            ports: Some(ports),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::router;

    fn d(spec: serde_json::Value) -> InferenceDeployment {
        InferenceDeployment::for_test(spec)
    }

    fn spec() -> serde_json::Value {
        serde_json::json!({
            "model": { "name": "tiny" }, "contextWindow": 1024,
            "prefill": { "replicas": 2, "kvPool": { "tokens": 4096, "dtype": "bf16" } },
            "decode": { "replicas": 3, "kvPool": { "memoryFraction": "0.9" } },
        })
    }

    #[test]
    fn decode_pods_mount_the_handoff_secret_and_carry_the_gate() {
        let dep = deployment(&d(spec()), Role::Decode, "abc", "img:1", 3, &Telemetry::logging(LogFormat::Json));
        assert_eq!(dep.metadata.name.as_deref(), Some("llm-decode-abc"));
        assert_eq!(dep.spec.replicas, Some(3));
        let pod = dep.spec.template.spec.unwrap();
        assert_eq!(pod.readiness_gates.unwrap()[0].condition_type, gate::CONDITION);
        assert_eq!(pod.volumes.unwrap()[0].secret.as_ref().unwrap().secret_name.as_deref(), Some("llm-handoff-uid-1"));
        assert_eq!(pod.automount_service_account_token, Some(false));
        let c = &pod.containers[0];
        let args = c.args.clone().unwrap();
        for want in [
            "decode",
            "--listen=0.0.0.0:8082",
            "--kv-listen=0.0.0.0:8083",
            "--kv-advertise=$(POD_IP):8083",
            "--handoff-secret-file=/var/run/kvgate/handoff/secret",
            "--context-window=1024",
            "--kv-memory-fraction=0.9",
            "--model=tiny",
            "--log-format=json",
        ] {
            assert!(args.iter().any(|a| a == want), "{want} missing from {args:?}");
        }
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!((sc.read_only_root_filesystem, sc.allow_privilege_escalation), (Some(true), Some(false)));
        assert_eq!(pod.security_context.unwrap().run_as_non_root, Some(true));
        // The owner reference makes deletion cascade.
        assert_eq!(dep.metadata.owner_references.unwrap()[0].uid, "uid-1");
    }

    #[test]
    fn prefill_pods_get_their_pool_flags_and_the_secret_but_no_token() {
        let dep = deployment(&d(spec()), Role::Prefill, "abc", "img:1", 2, &Telemetry::logging(LogFormat::Json));
        let pod = dep.spec.template.spec.unwrap();
        assert_eq!(pod.volumes.unwrap()[0].secret.as_ref().unwrap().secret_name.as_deref(), Some("llm-handoff-uid-1"));
        assert_eq!(pod.automount_service_account_token, Some(false));
        let args = pod.containers[0].args.clone().unwrap();
        assert!(args.contains(&"--kv-pool-tokens=4096".to_string()) && args.contains(&"--kv-dtype=bf16".to_string()), "{args:?}");
        assert!(args.contains(&"--handoff-secret-file=/var/run/kvgate/handoff/secret".to_string()), "{args:?}");
    }

    #[test]
    fn a_checkpoint_on_a_claim_is_mounted_read_only_at_models() {
        let mut s = spec();
        s["model"] = serde_json::json!({ "path": "qwen", "volume": { "persistentVolumeClaim": "weights" } });
        let dep = deployment(&d(s), Role::Prefill, "abc", "img:1", 1, &Telemetry::logging(LogFormat::Json));
        let pod = dep.spec.template.spec.unwrap();
        let v = &pod.volumes.unwrap()[0];
        assert_eq!(v.persistent_volume_claim.as_ref().unwrap().claim_name, "weights");
        assert!(pod.containers[0].args.as_ref().unwrap().contains(&"--model=/models/qwen".to_string()));
        assert_eq!(pod.containers[0].volume_mounts.as_ref().unwrap()[0].read_only, Some(true));
    }

    #[test]
    fn the_router_discovers_peers_and_admits_the_window_it_is_given() {
        let dep = router::deployment(&d(spec()), "img:1", 512, &Telemetry::logging(LogFormat::Json));
        let pod = dep.spec.template.spec.unwrap();
        assert_eq!(pod.service_account_name.as_deref(), Some("llm-router"));
        let args = pod.containers[0].args.clone().unwrap();
        for want in
            ["--prefill-service=llm-prefill", "--decode-service=llm-decode", "--context-window=512", "--handoff-secret-file=/var/run/kvgate/handoff/secret"]
        {
            assert!(args.iter().any(|a| a == want), "{want} missing from {args:?}");
        }
        assert_eq!(pod.volumes.unwrap()[0].secret.as_ref().unwrap().secret_name.as_deref(), Some("llm-handoff-uid-1"));
        // Liveness asks whether the process works, readiness whether it can serve: a router
        // without verified peers is not ready, but must not be restarted for it.
        let c = &pod.containers[0];
        assert_eq!(c.liveness_probe.as_ref().unwrap().http_get.as_ref().unwrap().path.as_deref(), Some("/healthz"));
        assert_eq!(c.readiness_probe.as_ref().unwrap().http_get.as_ref().unwrap().path.as_deref(), Some("/readyz"));
        let role = router::role(&d(spec()));
        let rule = &role.rules.unwrap()[0];
        assert_eq!(
            (rule.resources.clone().unwrap(), rule.verbs.clone()),
            (vec!["endpointslices".to_string()], vec!["get".to_string(), "list".into(), "watch".into()])
        );
    }

    #[test]
    fn with_an_otlp_endpoint_worker_pods_get_the_standard_variables_and_none_without() {
        let t = Telemetry { log: LogFormat::Json, otlp_endpoint: Some("http://collector:4318".into()) };
        let env = worker_env(&t);
        let get = |n: &str| env.iter().find(|e| e.name == n).and_then(|e| e.value.clone());
        assert_eq!(get("OTEL_EXPORTER_OTLP_ENDPOINT").as_deref(), Some("http://collector:4318"));
        assert!(get("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| a.contains("k8s.pod.name=$(POD_NAME)")));
        assert!(worker_env(&Telemetry::logging(LogFormat::Json)).iter().all(|e| !e.name.starts_with("OTEL_")));
        assert_eq!(get("KVGATE_SHUTDOWN_DELAY_MS").as_deref(), Some("3000"), "a stopping pod still accepts while it leaves the endpoints");
    }
}
