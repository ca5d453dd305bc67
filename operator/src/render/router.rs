//! The router: its Deployment, the Service of the deployment's API, and the ServiceAccount and
//! Role with which it reads the workers' EndpointSlices.

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{Container, ContainerPort, PodSpec, PodTemplateSpec, SecretVolumeSource, Service, ServiceAccount, Volume, VolumeMount};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role as RbacRole, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kvgate_proto::contract::flag;

use super::workers::{Telemetry, handoff_secret, http_probe, model_flag, restricted, service_name, worker_env};
use super::{ROUTER_PORT, name, owned_meta, placement};
use crate::crd::InferenceDeployment;
use crate::gate::Role;
use crate::labels;

pub const COMPONENT: &str = "router";

pub fn router_name(d: &InferenceDeployment) -> String {
    format!("{}-router", name(d))
}

/// The router's Deployment. `context_window` is the serving revision's: while a bigger window
/// waits for (or is refused by) the gate, the router keeps admitting what is verified.
pub fn deployment(d: &InferenceDeployment, image: &str, context_window: u64, telemetry: &Telemetry) -> Deployment {
    let n = name(d);
    let selector = labels::role_selector(n, COMPONENT);
    let r = &d.spec.router;
    let (model, model_volume) = model_flag(d);
    let (pod_sc, container_sc) = restricted();
    let (secret_volume, secret_mount, secret_flag) = handoff_secret(d);
    let args = vec![
        "router".to_string(),
        flag::arg(flag::LISTEN, format!("0.0.0.0:{ROUTER_PORT}")),
        flag::arg(flag::LOG_FORMAT, telemetry.log.as_str()),
        flag::arg(flag::PREFILL_SERVICE, service_name(d, Role::Prefill)),
        flag::arg(flag::DECODE_SERVICE, service_name(d, Role::Decode)),
        flag::arg(flag::MODEL, model),
        flag::arg(flag::CONTEXT_WINDOW, context_window),
        secret_flag,
    ];
    let (auth_args, auth_volume, auth_mount) = auth(d);
    let args: Vec<String> = args.into_iter().chain(auth_args).collect();
    let mut mounts: Vec<_> = std::iter::once(secret_mount).chain(auth_mount).collect();
    mounts.extend(model_volume.as_ref().map(|v| k8s_openapi::api::core::v1::VolumeMount {
        name: v.name.clone(),
        mount_path: super::MODEL_DIR.into(),
        read_only: Some(true),
        ..Default::default()
    }));
    let volumes: Vec<_> = std::iter::once(secret_volume).chain(model_volume).chain(auth_volume).collect();
    Deployment {
        metadata: owned_meta(d, router_name(d), labels::with(labels::common(n), selector.clone())),
        spec: DeploymentSpec {
            replicas: Some(r.replicas),
            selector: LabelSelector { match_labels: Some(selector.clone()), ..Default::default() },
            template: super::pod_options::apply(
                PodTemplateSpec {
                    metadata: Some(ObjectMeta {
                        labels: Some(labels::pod(labels::with(labels::common(n), selector), d.metadata.uid.as_deref())),
                        ..Default::default()
                    }),
                    spec: Some(placement::placed(
                        PodSpec {
                            service_account_name: Some(router_name(d)),
                            containers: vec![Container {
                                name: "router".into(),
                                image: Some(image.into()),
                                args: Some(args),
                                env: Some(worker_env(telemetry)),
                                ports: Some(vec![ContainerPort { name: Some("http".into()), container_port: ROUTER_PORT, ..Default::default() }]),
                                readiness_probe: Some(http_probe("/readyz", 2)),
                                liveness_probe: Some(http_probe("/healthz", 10)),
                                resources: r.resources.clone(),
                                security_context: Some(container_sc),
                                volume_mounts: Some(mounts),
                                ..Default::default()
                            }],
                            security_context: Some(pod_sc),
                            volumes: Some(volumes),
                            termination_grace_period_seconds: Some(super::workers::TERMINATION_GRACE_SECONDS),
                            ..Default::default()
                        },
                        d,
                        &r.placement,
                        None,
                        None,
                    )),
                },
                &r.pod,
            ),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Where the router finds the API keys Secret.
pub const API_KEYS_DIR: &str = "/etc/kvgate/api-keys";

/// `spec.auth` as the router's flags, and the API keys Secret's volume and mount. The Secret is
/// the user's: mounted, never read by the operator.
fn auth(d: &InferenceDeployment) -> (Vec<String>, Option<Volume>, Option<VolumeMount>) {
    let Some(auth) = &d.spec.auth else { return (Vec::new(), None, None) };
    let mut args = Vec::new();
    let (mut volume, mut mount) = (None, None);
    if let Some(secret) = &auth.api_keys_secret {
        args.push(flag::arg(flag::API_KEYS, API_KEYS_DIR));
        volume = Some(Volume {
            name: "api-keys".into(),
            secret: Some(SecretVolumeSource { secret_name: Some(secret.clone()), default_mode: Some(0o400), ..Default::default() }),
            ..Default::default()
        });
        mount = Some(VolumeMount { name: "api-keys".into(), mount_path: API_KEYS_DIR.into(), read_only: Some(true), ..Default::default() });
    }
    if let Some(proxy) = &auth.trusted_proxy {
        args.push(flag::arg(flag::TRUSTED_PROXY_HEADER, &proxy.header));
        args.extend(proxy.source_ranges.iter().map(|r| flag::arg(flag::TRUSTED_PROXY_CIDR, r)));
    }
    args.extend(auth.tokens_per_minute.map(|n| flag::arg(flag::TENANT_TOKENS_PER_MINUTE, n)));
    args.extend(auth.tenants.iter().map(|t| flag::arg(flag::TENANT_QUOTA, format!("{}={}", t.name, t.tokens_per_minute))));
    (args, volume, mount)
}

/// The deployment's API: `<name>` port 80 -> the routers.
pub fn api_service(d: &InferenceDeployment) -> Service {
    super::api_service(d, COMPONENT)
}

pub fn service_account(d: &InferenceDeployment) -> ServiceAccount {
    ServiceAccount { metadata: owned_meta(d, router_name(d), labels::common(name(d))), ..Default::default() }
}

/// Exactly what discovery needs: read EndpointSlices in this namespace.
pub fn role(d: &InferenceDeployment) -> RbacRole {
    RbacRole {
        metadata: owned_meta(d, router_name(d), labels::common(name(d))),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec!["discovery.k8s.io".into()]),
            resources: Some(vec!["endpointslices".into()]),
            verbs: vec!["get".into(), "list".into(), "watch".into()],
            ..Default::default()
        }]),
    }
}

pub fn role_binding(d: &InferenceDeployment) -> RoleBinding {
    RoleBinding {
        metadata: owned_meta(d, router_name(d), labels::common(name(d))),
        role_ref: RoleRef { api_group: Some("rbac.authorization.k8s.io".into()), kind: "Role".into(), name: router_name(d) },
        subjects: Some(vec![Subject { kind: "ServiceAccount".into(), name: router_name(d), namespace: d.metadata.namespace.clone(), ..Default::default() }]),
    }
}
