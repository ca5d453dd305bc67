//! The `InferenceDeployment` custom resource (`kvgate.dev/v1alpha1`, short name `infd`).
//!
//! Doc comments become the schema's descriptions (`kubectl explain infd.spec...`); schema ranges
//! and CEL rules make the API server reject bad specs with the field's name.

// kube-derive repeats `type_ = ...` across printcolumns, which this lint mistakes for duplicates.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, LocalObjectReference, ResourceRequirements, SecretKeySelector, Toleration, TopologySpreadConstraint, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use kvgate_proto::contract;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::role::Role;
use crate::rollout_state::{Phase, RefusalReason};

/// A disaggregated LLM deployment: a router, prefill workers and decode workers, rolled out only
/// when every worker's measured KV pool holds the declared context window.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "kvgate.dev",
    version = "v1alpha1",
    kind = "InferenceDeployment",
    namespaced,
    shortname = "infd",
    category = "kvgate",
    status = "InferenceDeploymentStatus",
    doc = "A disaggregated LLM deployment: a router, prefill workers and decode workers of one model. The operator rolls a revision out only when every prefill and decode pod has measured a KV pool at least as large as spec.contextWindow; a revision that falls short is refused (status.refusedRevision, condition RolloutRefused) and never receives traffic.",
    printcolumn(
        name = "Engine",
        type_ = "string",
        json_path = ".spec.engine",
        description = "kvgate (its own prefill/decode workers), llamacpp, vllm or sglang"
    ),
    printcolumn(name = "Window", type_ = "integer", json_path = ".spec.contextWindow", description = "Declared context window (tokens)"),
    printcolumn(
        name = "Pool",
        type_ = "integer",
        json_path = ".status.minMeasuredTokens",
        description = "Smallest measured per-request KV capacity of the current revision's pods, any role (tokens)"
    ),
    printcolumn(
        name = "Prefill-Pool",
        type_ = "integer",
        json_path = ".status.prefill.minMeasuredTokens",
        description = "Smallest measured prefill KV pool of the current revision (tokens)",
        priority = "1"
    ),
    printcolumn(
        name = "Decode-Pool",
        type_ = "integer",
        json_path = ".status.decode.minMeasuredTokens",
        description = "Smallest measured decode KV pool of the current revision (tokens)",
        priority = "1"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.ready",
        description = "Ready pods of the serving revision: router/prefill/decode, or the engine's server pods"
    ),
    printcolumn(
        name = "Status",
        type_ = "string",
        json_path = ".status.phase",
        description = "Progressing, Canary, Baking, Available, Degraded, RolledBack or Refused"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.reason",
        description = "Why it is not simply Available: the refusal's, the degradation's or the rollout's reason (kubectl kvgate why NAME explains it)"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.prefill) || !has(self.decode) || !has(self.prefill.kvPool) || !has(self.decode.kvPool) || self.prefill.kvPool.pageSize == self.decode.kvPool.pageSize").message("spec.prefill.kvPool.pageSize must equal spec.decode.kvPool.pageSize: decode stores the pages prefill sends").reason(Reason::FieldValueInvalid).field_path(".prefill.kvPool.pageSize"))]
#[x_kube(validation = Rule::new("self.engine != 'kvgate' || (has(self.prefill) && has(self.decode) && has(self.prefill.kvPool) && has(self.decode.kvPool))").message("spec.prefill.kvPool and spec.decode.kvPool are required with engine kvgate").reason(Reason::FieldValueRequired).field_path(".prefill"))]
#[x_kube(validation = Rule::new("self.engine != 'kvgate' || ((!has(self.prefill) || !has(self.prefill.container)) && (!has(self.decode) || !has(self.decode.container)) && !has(self.router.container))").message("spec.prefill.container, spec.decode.container and spec.router.container are an external engine's: engine kvgate runs its own workers").reason(Reason::FieldValueForbidden).field_path(".prefill"))]
#[x_kube(validation = Rule::new("self.engine != 'kvgate' || !has(self.server)").message("spec.server is an external engine's single serving role, not allowed with engine kvgate").reason(Reason::FieldValueForbidden).field_path(".server"))]
#[x_kube(validation = Rule::new("self.engine == 'kvgate' || has(self.server) != (has(self.prefill) || has(self.decode))").message("an external engine serves from spec.server (one serving role) or from spec.prefill, spec.decode and spec.router (disaggregated): set exactly one of the two").reason(Reason::FieldValueInvalid).field_path(".server"))]
#[x_kube(validation = Rule::new("self.engine == 'kvgate' || has(self.prefill) == has(self.decode)").message("a disaggregated engine needs both spec.prefill and spec.decode").reason(Reason::FieldValueRequired).field_path(".decode"))]
#[x_kube(validation = Rule::new("self.engine != 'llamacpp' || !has(self.prefill)").message("llama.cpp has no disaggregated prefill/decode serving: use spec.server").reason(Reason::FieldValueForbidden).field_path(".prefill"))]
#[x_kube(validation = Rule::new("self.engine == 'kvgate' || !has(self.prefill) || (has(self.prefill.container) && has(self.decode.container) && has(self.router.container))").message("a disaggregated engine's roles are containers: spec.prefill.container, spec.decode.container and spec.router.container are required").reason(Reason::FieldValueRequired).field_path(".router.container"))]
#[x_kube(validation = Rule::new("self.engine == 'kvgate' || !has(self.prefill) || (!has(self.prefill.kvPool) && !has(self.decode.kvPool) && !has(self.prefill.resources) && !has(self.decode.resources) && !has(self.router.resources))").message("kvPool and resources are kvgate's worker settings: an external engine sizes its KV cache with its own flags and sets resources in its container").reason(Reason::FieldValueForbidden).field_path(".prefill"))]
#[x_kube(validation = Rule::new("self.engine == 'kvgate' || !has(self.model.name)").message("spec.model.name (a built-in model) is kvgate's: an external engine loads spec.model.path or spec.model.hub").reason(Reason::FieldValueForbidden).field_path(".model.name"))]
#[x_kube(validation = Rule::new("self.engine != 'kvgate' || !has(self.model.hub)").message("spec.model.hub is for external engines, which download a model themselves: kvgate's workers load spec.model.path from spec.model.volume (a persistentVolumeClaim or hostPath)").reason(Reason::FieldValueForbidden).field_path(".model.hub"))]
#[x_kube(validation = Rule::new("self.engine != 'kvgate' || !has(self.router.serviceAccountName)").message("spec.router.serviceAccountName: kvgate's router runs as the ServiceAccount the operator makes for it (it reads its workers' EndpointSlices)").reason(Reason::FieldValueForbidden).field_path(".router.serviceAccountName"))]
#[x_kube(validation = Rule::new("self.engine != 'kvgate' || !has(self.model.path) || has(self.model.volume)").message("spec.model.path needs spec.model.volume: the volume the checkpoint is on").reason(Reason::FieldValueRequired).field_path(".model.volume"))]
#[x_kube(validation = Rule::new("self.engine == 'kvgate' || !has(self.auth)").message("spec.auth is enforced by kvgate's router: for an external engine use the engine's own API key or a gateway").reason(Reason::FieldValueForbidden).field_path(".auth"))]
#[x_kube(validation = Rule::new("self.engine == 'vllm' || ((!has(self.prefill) || !has(self.prefill.verifyHandoff)) && (!has(self.decode) || !has(self.decode.verifyHandoff)))").message("verifyHandoff is for engine vllm's prefill and decode (kvgate's connector inside vLLM): kvgate's own workers always verify, and SGLang's transfer backends offer no seam for it (docs/engines.md)").reason(Reason::FieldValueForbidden).field_path(".prefill.verifyHandoff"))]
#[x_kube(validation = Rule::new("!has(self.prefill) || !has(self.decode) || (has(self.prefill.verifyHandoff) ? self.prefill.verifyHandoff : true) == (has(self.decode.verifyHandoff) ? self.decode.verifyHandoff : true)").message("spec.prefill.verifyHandoff and spec.decode.verifyHandoff must be equal: decode refuses every handoff a prefill did not seal").reason(Reason::FieldValueInvalid).field_path(".decode.verifyHandoff"))]
#[x_kube(validation = Rule::new("self.engine == 'kvgate' || !has(self.image)").message("spec.image is kvgate's worker image: an external engine's image is spec.server.container.image").reason(Reason::FieldValueForbidden).field_path(".image"))]
pub struct InferenceDeploymentSpec {
    /// What serves requests: `kvgate` (the default: kvgate's router, prefill and decode workers,
    /// with handoff integrity) or an engine you already run, `llamacpp`, `vllm` or `sglang`,
    /// whose container is spec.server. Either way no pod takes traffic before its measured
    /// per-request capacity holds contextWindow. Immutable.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.engine is immutable: create another InferenceDeployment to change engines").reason(Reason::FieldValueForbidden))]
    pub engine: Engine,
    /// The model every role serves.
    pub model: ModelSpec,
    /// Declared context window in tokens: the most prompt + completion tokens one request may
    /// use. Every prefill and decode pod must measure a KV pool at least this large, or the
    /// revision is refused and never receives traffic.
    #[schemars(range(min = 1))]
    pub context_window: u64,
    /// Worker image (engine kvgate). Defaults to the kvgate-worker image of the operator's own
    /// version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Prefill pods: compute prompts' KV and hand it to decode. Engine kvgate: its workers
    /// (`kvPool`). Engines vllm and sglang, disaggregated: the engine's prefill servers
    /// (`container`, e.g. SGLang's `--disaggregation-mode prefill`), each read and gated on its
    /// own numbers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<WorkerRole>,
    /// Decode pods: take prefill's KV and generate. Engine kvgate: its workers (reserve pages,
    /// verify each handoff). Engines vllm and sglang, disaggregated: the engine's decode servers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<WorkerRole>,
    /// The router: the deployment's API, which pairs prefill with decode. Engine kvgate: its own
    /// router, one for every revision. Engines vllm and sglang, disaggregated: the engine's
    /// router (`container`, e.g. `sglang_router.launch_router --pd-disaggregation`), one per
    /// revision, sent only that revision's prefill and decode pods (env `KVGATE_PREFILL_HOST`,
    /// `KVGATE_DECODE_HOST`, ...) and Ready once they are verified. Ignored with spec.server.
    #[serde(default)]
    pub router: RouterRole,
    /// The external engine's pods when one server does all the work (engines llamacpp, vllm,
    /// sglang); disaggregated engines use spec.prefill, spec.decode and spec.router instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<ServerRole>,
    /// Handoff between prefill and decode.
    #[serde(default)]
    pub handoff: HandoffSpec,
    /// How a new revision is proven before it serves. Not part of the revision: changing it
    /// starts no rollout.
    #[serde(default)]
    pub rollout: RolloutSpec,
    /// When set, the operator also renders an `InferencePool` (Gateway API Inference Extension,
    /// `inference.networking.k8s.io/v1`) named like the deployment, over the pods that serve
    /// its API (the routers, or the engine's servers; only verified ones are Ready), so a
    /// gateway's endpoint picker can score them. Needs that CRD installed (condition
    /// InferencePoolReady says whether it is). Not part of the revision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_pool: Option<InferencePoolSpec>,
    /// Who may call the deployment's API (engine kvgate: its router) and how much each tenant
    /// may use. Without it nobody is authenticated and each client address is a tenant (for a
    /// deployment a gateway or NetworkPolicy already closes). Not part of the revision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<AuthSpec>,
}

/// A deployment for unit tests: `llm` in namespace `ns` with UID `uid-1`, from a JSON spec.
#[cfg(test)]
impl InferenceDeployment {
    pub fn for_test(spec: serde_json::Value) -> Self {
        let mut d = InferenceDeployment::new("llm", serde_json::from_value(spec).expect("a valid spec"));
        d.metadata.namespace = Some("ns".into());
        d.metadata.uid = Some("uid-1".into());
        d
    }
}

/// The settings of a kvgate role the spec leaves out (the CRD requires both with engine kvgate).
static ABSENT_WORKER: std::sync::LazyLock<WorkerRole> = std::sync::LazyLock::new(|| WorkerRole {
    replicas: 0,
    kv_pool: None,
    resources: None,
    container: None,
    port: None,
    verify_handoff: None,
    placement: Placement::default(),
    pod: PodOptions::default(),
});

impl InferenceDeploymentSpec {
    /// The prefill or decode settings.
    pub fn worker(&self, role: Role) -> &WorkerRole {
        let w = match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
            Role::Server | Role::Router => &None,
        };
        w.as_ref().unwrap_or(&ABSENT_WORKER)
    }

    /// The engine's container of `role` (external engines), and what the spec says around it.
    pub fn external(&self, role: Role) -> Option<ExternalRole<'_>> {
        let (replicas, container, port, placement, pod) = match role {
            Role::Server => self.server.as_ref().map(|s| (s.replicas, &s.container, s.port, &s.placement, &s.pod))?,
            Role::Router => (self.router.replicas, self.router.container.as_ref()?, self.router.port, &self.router.placement, &self.router.pod),
            Role::Prefill | Role::Decode => {
                let w = self.worker(role);
                (w.replicas, w.container.as_ref()?, w.port, &w.placement, &w.pod)
            }
        };
        Some(ExternalRole { replicas, container, port: port.and_then(|p| u16::try_from(p).ok()), placement, pod })
    }

    /// What the platform adds to each role's pods that the spec names, with the role's field path.
    pub fn pod_options(&self) -> impl Iterator<Item = (&'static str, &PodOptions)> {
        let workers = [("spec.prefill", &self.prefill), ("spec.decode", &self.decode)];
        let workers = workers.into_iter().filter_map(|(path, w)| Some((path, &w.as_ref()?.pod)));
        let server = self.server.as_ref().map(|s| ("spec.server", &s.pod));
        workers.chain(std::iter::once(("spec.router", &self.router.pod))).chain(server)
    }

    /// Pods the spec asks for in `role`.
    pub fn replicas(&self, role: Role) -> i32 {
        match role {
            Role::Server => self.server.as_ref().map_or(0, |s| s.replicas),
            Role::Router => self.router.replicas,
            _ => self.worker(role).replicas,
        }
    }
}

/// One role of an external engine: the user's container and where its pods run.
#[derive(Debug, Clone, Copy)]
pub struct ExternalRole<'a> {
    pub replicas: i32,
    pub container: &'a k8s_openapi::api::core::v1::Container,
    pub port: Option<u16>,
    pub placement: &'a Placement,
    pub pod: &'a PodOptions,
}

/// What serves requests.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, Default, JsonSchema, strum::IntoStaticStr, strum::VariantArray)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum Engine {
    // kvgate's router, prefill and decode workers (handoff integrity end to end).
    #[default]
    Kvgate,
    // llama.cpp's server: per-request capacity is /props default_generation_settings.n_ctx.
    Llamacpp,
    // vLLM: the smaller of /v1/models max_model_len and the KV cache in vllm:cache_config_info.
    Vllm,
    // SGLang: /get_server_info max_total_num_tokens, max_req_input_len, context_length.
    Sglang,
}

impl Engine {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// An external engine's pods.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServerRole {
    /// Pods of the engine.
    #[serde(default = "one")]
    #[schemars(range(min = 0, max = 1000))]
    pub replicas: i32,
    /// The engine's container, as in a pod spec: image, command and args (the engine's own
    /// flags: its context size, slots, KV cache), env, resources, probes, securityContext. The
    /// operator adds the model volume (read-only at /models), a port named `http` when the
    /// container names none, health probes on the engine's health endpoint when it has none,
    /// and the restricted security context when it sets none.
    // Boxed, as in the roles below: a `Container` is 2.3 KB inline, and the watch caches every
    // InferenceDeployment (12 KB each with four inline, against 2.8 KB).
    pub container: Box<k8s_openapi::api::core::v1::Container>,
    /// The port the engine serves HTTP on: its OpenAI-compatible API and what the operator reads
    /// its capacity from. Default: llamacpp 8080, vllm 8000, sglang 30000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
    /// Where the pods run.
    #[serde(flatten)]
    pub placement: Placement,
    /// What the platform adds to the pods.
    #[serde(flatten)]
    pub pod: PodOptions,
}

/// Which model: the built-in `tiny` model, a checkpoint on a volume, or (external engines) a
/// model-hub name the engine downloads itself.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("[has(self.name), has(self.path), has(self.hub)].filter(x, x).size() == 1").message("set exactly one of spec.model.name (a built-in model), spec.model.path (a checkpoint on spec.model.volume) and spec.model.hub (a model-hub name an external engine downloads)").reason(Reason::FieldValueInvalid))]
#[x_kube(validation = Rule::new("!has(self.tokenSecret) || has(self.hub)").message("spec.model.tokenSecret is the model hub's access token: it needs spec.model.hub").reason(Reason::FieldValueInvalid).field_path(".tokenSecret"))]
#[x_kube(validation = Rule::new("!has(self.path) || has(self.volume)").message("spec.model.path needs spec.model.volume: the volume the checkpoint is on").reason(Reason::FieldValueRequired).field_path(".volume"))]
pub struct ModelSpec {
    /// A built-in model: `tiny` (Llama-shaped, seeded weights, for tests and demos).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self == 'tiny'").message("spec.model.name: the only built-in model is 'tiny'; use spec.model.path for a checkpoint").reason(Reason::FieldValueInvalid))]
    pub name: Option<String>,
    /// A checkpoint inside `volume`, relative to the volume's root: a directory (config.json,
    /// *.safetensors, tokenizer.json) or a `.gguf` file (kvgate's workers and llama.cpp).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The volume holding the checkpoint, mounted read-only at /models in every pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<ModelVolume>,
    /// A model-hub name, e.g. `meta-llama/Llama-3.1-8B-Instruct` (external engines only): the
    /// engine downloads it, so no volume is needed. The operator passes it to the engine's
    /// containers as env `KVGATE_MODEL` (use `$(KVGATE_MODEL)` in args), as it passes
    /// `/models/<path>` for spec.model.path. kvgate's own workers load only from a volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub hub: Option<String>,
    /// The key of a Secret (in the deployment's namespace) holding the hub's access token,
    /// passed to the engine's containers as env `HF_TOKEN`, which vLLM, SGLang and llama.cpp
    /// read. The operator never reads it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "terse::<Option<SecretKeySelector>>")]
    pub token_secret: Option<SecretKeySelector>,
}

/// Where a checkpoint lives.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.persistentVolumeClaim) != has(self.hostPath)").message("spec.model.volume: set exactly one of persistentVolumeClaim and hostPath").reason(Reason::FieldValueInvalid))]
pub struct ModelVolume {
    /// Name of a PersistentVolumeClaim in the deployment's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<String>,
    /// A directory on the node. Refused (RolloutRefused, reason HostPathNotAllowed, no pod
    /// created) unless it is under a prefix the operator was started with
    /// (`--allowed-host-paths`, chart value `allowedHostPaths`; empty by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
}

/// Prefill or decode pods: kvgate's workers (`kvPool`, `resources`) or a disaggregated
/// engine's servers (`container`, `port`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WorkerRole {
    /// Pods of this role.
    #[serde(default = "one")]
    #[schemars(range(min = 0, max = 1000))]
    pub replicas: i32,
    /// The worker's KV pool (engine kvgate, required there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_pool: Option<KvPoolSpec>,
    /// CPU, memory and accelerator requests and limits of the worker container (engine kvgate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// The engine's container for this role (engines vllm and sglang, disaggregated), as in
    /// spec.server.container: the operator adds the model volume, a port named `http`, health
    /// probes and the restricted security context where the container sets none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "terse::<Option<k8s_openapi::api::core::v1::Container>>")]
    pub container: Option<Box<k8s_openapi::api::core::v1::Container>>,
    /// The port the engine's container serves HTTP on (its capacity is read there). Default:
    /// the engine's (vllm 8000, sglang 30000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
    /// Engine vllm: verify every KV block the role's KV connector moves. The operator wraps the
    /// connector `--kv-transfer-config` names in kvgate's (engines/vllm, mounted from a
    /// ConfigMap it writes) with the deployment's handoff secret; decode refuses a handoff whose
    /// blocks do not verify (vLLM's kv_load_failure_policy, default fail). Default: on wherever
    /// the container sets --kv-transfer-config; false runs the connector unverified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify_handoff: Option<bool>,
    /// Where the pods run.
    #[serde(flatten)]
    pub placement: Placement,
    /// What the platform adds to the pods.
    #[serde(flatten)]
    pub pod: PodOptions,
}

/// Where a role's pods run. Without `topologySpreadConstraints`, prefill and decode pods of a
/// revision spread across nodes (and routers, and an engine's servers, among themselves), softly:
/// a cluster of one node still runs them all.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    /// Node labels the pods must match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Taints the pods tolerate. A lost node's `node.kubernetes.io/not-ready` and `unreachable`
    /// taints are tolerated for 30 s (then the pods are evicted and replaced elsewhere) unless
    /// a toleration here names them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    /// Node and pod affinity, as in a pod spec (`kubectl explain pod.spec.affinity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "terse::<Affinity>")]
    pub affinity: Option<Affinity>,
    /// Topology spread, as in a pod spec (`kubectl explain pod.spec.topologySpreadConstraints`);
    /// replaces the default spread across nodes (an empty list turns spreading off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "terse::<Vec<TopologySpreadConstraint>>")]
    pub topology_spread_constraints: Option<Vec<TopologySpreadConstraint>>,
}

/// What a platform adds to a role's pods: the identity they run as, their scheduling and runtime
/// class, pull secrets, labels and annotations, and volumes. What the operator itself renders
/// (its labels, the model and handoff-secret volumes and their mounts) cannot be replaced.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodOptions {
    /// Labels and annotations added to the pods (cost attribution, service mesh, network
    /// policies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_metadata: Option<PodMetadata>,
    /// Secrets of the deployment's namespace to pull the pods' images with, as in a pod spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "terse_list::<LocalObjectReference, 16>")]
    pub image_pull_secrets: Option<Vec<LocalObjectReference>>,
    /// The ServiceAccount the pods run as (e.g. one bound to a cloud identity that reads model
    /// storage). Its API token is not mounted: neither workers nor engines call the API server
    /// (a platform that injects its own projected token still does). Not allowed on kvgate's
    /// router, which runs as the ServiceAccount the operator makes for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub service_account_name: Option<String>,
    /// The PriorityClass of the pods, as in a pod spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub priority_class_name: Option<String>,
    /// The RuntimeClass of the pods (e.g. `nvidia`), as in a pod spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub runtime_class_name: Option<String>,
    /// More volumes for the pods, as in a pod spec (mount them with volumeMounts). A hostPath
    /// volume is refused (HostPathNotAllowed) unless it is under the operator's
    /// --allowed-host-paths, as spec.model.volume.hostPath is. The names model, handoff-secret
    /// and api-keys are the operator's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "volumes")]
    #[x_kube(validation = Rule::new("self.all(v, !(v.name in ['model', 'handoff-secret', 'api-keys']))").message("volumes: the names model, handoff-secret and api-keys are the operator's").reason(Reason::FieldValueForbidden))]
    pub volumes: Option<Vec<Volume>>,
    /// Mounts added to the role's container (kvgate's worker or router, or the engine's
    /// container), as in a container spec. A mount at /tmp or /dev/shm replaces the scratch
    /// volume the operator puts there; /models, /var/run/kvgate and /etc/kvgate are the
    /// operator's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "terse_list::<VolumeMount, 32>")]
    #[x_kube(validation = Rule::new("self.all(m, m.mountPath != '/models' && !m.mountPath.startsWith('/models/') && !m.mountPath.startsWith('/var/run/kvgate') && !m.mountPath.startsWith('/etc/kvgate'))").message("volumeMounts: /models, /var/run/kvgate and /etc/kvgate are where the operator mounts the model and kvgate's secrets").reason(Reason::FieldValueForbidden))]
    pub volume_mounts: Option<Vec<VolumeMount>>,
}

/// Labels and annotations for a role's pods.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodMetadata {
    /// Labels added to the pods. Keys under app.kubernetes.io/ and kvgate.dev/ are the operator's
    /// (its selectors and gate rely on them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxProperties" = 64))]
    #[x_kube(validation = Rule::new("self.all(k, !k.startsWith('app.kubernetes.io/') && !k.startsWith('kvgate.dev/'))").message("podMetadata.labels: keys under app.kubernetes.io/ and kvgate.dev/ are the operator's").reason(Reason::FieldValueForbidden))]
    pub labels: Option<BTreeMap<String, String>>,
    /// Annotations added to the pods. Keys under kvgate.dev/ are the operator's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxProperties" = 64))]
    #[x_kube(validation = Rule::new("self.all(k, !k.startsWith('kvgate.dev/'))").message("podMetadata.annotations: keys under kvgate.dev/ are the operator's").reason(Reason::FieldValueForbidden))]
    pub annotations: Option<BTreeMap<String, String>>,
}

fn one() -> i32 {
    1
}

/// KV pool of a worker. The pool is allocated (and every byte touched) at start-up; what the
/// worker then measures is what the rollout gate checks.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("[has(self.bytes), has(self.tokens), has(self.memoryFraction)].filter(x, x).size() <= 1").message("set at most one of kvPool.bytes, kvPool.tokens and kvPool.memoryFraction").reason(Reason::FieldValueInvalid))]
pub struct KvPoolSpec {
    /// Tokens per KV page, a power of two from 1 to 1024. Must be equal for prefill and decode.
    #[serde(default = "page_size")]
    #[x_kube(validation = Rule::new(contract::PAGE_SIZE_RULE).message(contract::PAGE_SIZE_RULE_MESSAGE).reason(Reason::FieldValueInvalid))]
    pub page_size: u32,
    /// Pool size in bytes (rounded down to whole pages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub bytes: Option<u64>,
    /// Pool size in tokens (rounded up to whole pages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub tokens: Option<u64>,
    /// Pool size as a fraction of the memory the worker may use after loading the model, as a
    /// decimal string in (0, 1], e.g. "0.9". Without any size the pool holds 4 context windows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^(0?\\\\.[0-9]*[1-9][0-9]*|1(\\\\.0*)?)$')").message("memoryFraction must be a decimal in (0, 1], e.g. \"0.9\"").reason(Reason::FieldValueInvalid))]
    pub memory_fraction: Option<String>,
    /// Element type of stored K/V: f32, f16, bf16, or q8_0 (8-bit values in blocks of 32 with an
    /// f16 scale: about 1.9 times the tokens of f16 in the same bytes; the model's kv heads x
    /// head dim must be a multiple of 32).
    #[serde(default = "dtype")]
    #[schemars(extend("enum" = ["f32", "f16", "bf16", "q8_0"]))]
    pub dtype: String,
    /// Where the pool lives: `cpu`, `cuda` or `cuda:N` (the CUDA worker image).
    #[serde(default = "device")]
    #[schemars(regex(pattern = r"^(cpu|cuda(:[0-9]+)?)$"))]
    pub device: String,
}

impl Default for KvPoolSpec {
    fn default() -> Self {
        KvPoolSpec { page_size: page_size(), bytes: None, tokens: None, memory_fraction: None, dtype: dtype(), device: device() }
    }
}

fn page_size() -> u32 {
    16
}
fn dtype() -> String {
    "f32".into()
}
fn device() -> String {
    "cpu".into()
}

/// The router.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RouterRole {
    /// Router pods.
    #[serde(default = "one")]
    #[schemars(range(min = 0, max = 1000))]
    pub replicas: i32,
    /// Requests and limits of the router container (engine kvgate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// A disaggregated engine's router container (engines vllm and sglang with spec.prefill):
    /// it reaches its revision's pods at `$(KVGATE_PREFILL_HOST):$(KVGATE_PREFILL_PORT)` and
    /// `$(KVGATE_DECODE_HOST):$(KVGATE_DECODE_PORT)` (headless Services of that revision).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "terse::<Option<k8s_openapi::api::core::v1::Container>>")]
    pub container: Option<Box<k8s_openapi::api::core::v1::Container>>,
    /// The port the router serves HTTP on. Default: the engine's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
    /// Where the pods run.
    #[serde(flatten)]
    pub placement: Placement,
    /// What the platform adds to the pods.
    #[serde(flatten)]
    pub pod: PodOptions,
}

impl Default for RouterRole {
    fn default() -> Self {
        RouterRole { replicas: 1, resources: None, container: None, port: None, placement: Placement::default(), pod: PodOptions::default() }
    }
}

/// Handoff between prefill and decode.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HandoffSpec {
    /// How long decode holds a reservation waiting for prefill's commit before freeing it.
    #[serde(default = "timeout_ms")]
    #[schemars(range(min = 100, max = 600000))]
    pub timeout_ms: u64,
    /// No longer supported, and refused when set: the operator derives each deployment's handoff
    /// secret from its own root key, so it never needs to read a Secret outside its namespace
    /// (docs/operator.md, "Least privilege"). Objects that had it keep it unchanged; it is ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("false").message("spec.handoff.secretName is no longer supported: the operator generates and owns each deployment's handoff secret (see docs/operator.md, Least privilege); remove the field").reason(Reason::FieldValueForbidden))]
    pub secret_name: Option<String>,
}

impl Default for HandoffSpec {
    fn default() -> Self {
        HandoffSpec { timeout_ms: timeout_ms(), secret_name: None }
    }
}

fn timeout_ms() -> u64 {
    30_000
}

/// Tenants of the API: API keys from a Secret, or a gateway trusted to name the tenant, and
/// per-tenant token quotas.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.apiKeysSecret) || has(self.trustedProxy)").message("spec.auth needs apiKeysSecret, trustedProxy or both: with neither nobody would be authenticated").reason(Reason::FieldValueRequired).field_path(".apiKeysSecret"))]
pub struct AuthSpec {
    /// A Secret in the deployment's namespace: one data key per tenant (the tenant's name), its
    /// value that tenant's API keys, one per line, at least 16 characters each. The router mounts
    /// it and reads it again when it changes (no restart); the operator never reads or copies
    /// it. Requests without a known `Authorization: Bearer` key get 401.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub api_keys_secret: Option<String>,
    /// A gateway in front that authenticates clients itself and names the tenant in a header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trusted_proxy: Option<TrustedProxySpec>,
    /// Prompt + generated tokens per minute each tenant may use; more is answered 429 naming the
    /// quota. Absent: no quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub tokens_per_minute: Option<u64>,
    /// Tenants with a quota of their own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub tenants: Vec<TenantQuota>,
}

/// A gateway trusted to name the tenant.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TrustedProxySpec {
    /// The header the gateway names the tenant in (e.g. `x-tenant`).
    #[schemars(length(min = 1, max = 128), regex(pattern = r"^[A-Za-z0-9-]+$"))]
    pub header: String,
    /// The gateway's source addresses (CIDR): the header is believed from these only. Without
    /// apiKeysSecret, requests from anywhere else get 401.
    #[schemars(length(min = 1, max = 32), inner(length(max = 43)))]
    #[x_kube(validation = Rule::new("self.all(r, isCIDR(r))").message("spec.auth.trustedProxy.sourceRanges must be CIDR ranges such as 10.0.0.0/8").reason(Reason::FieldValueInvalid))]
    pub source_ranges: Vec<String>,
}

/// One tenant's own quota.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TenantQuota {
    /// The tenant: its data key in apiKeysSecret, or the name the gateway sends.
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[A-Za-z0-9._-]+$"))]
    pub name: String,
    /// Prompt + generated tokens per minute.
    #[schemars(range(min = 1))]
    pub tokens_per_minute: u64,
}

/// The `InferencePool` the operator renders for a gateway.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// The endpoint picker (EPP) the gateway asks which pod serves a request: a Service in the
    /// deployment's namespace, which you deploy.
    pub endpoint_picker: EndpointPickerRef,
}

/// A Service running the Gateway API Inference Extension's endpoint picker.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    /// The Service's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The Service port of the picker's ext-proc gRPC listener.
    #[serde(default = "epp_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// What the gateway does when the picker does not answer: `FailClose` (the default: the
    /// request fails) or `FailOpen` (the gateway picks an endpoint itself).
    #[serde(default = "fail_close")]
    #[schemars(extend("enum" = ["FailOpen", "FailClose"]))]
    pub failure_mode: String,
}

fn epp_port() -> i32 {
    9002
}

fn fail_close() -> String {
    "FailClose".into()
}

/// How a new revision is proven before it serves.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutSpec {
    /// The integrity canary every candidate revision passes before its pods take traffic: the
    /// operator drives fixed greedy prompts through every candidate prefill x decode pair and
    /// refuses the revision (CanaryFailed) unless every pair answers, all agree token for token
    /// (and with the serving revision, for the same model and layout) and no pod counts a
    /// handoff mismatch.
    #[serde(default)]
    pub canary: CanarySpec,
    /// After a promotion, how long the previous revision's Deployments stay (at their size)
    /// while the operator watches the deployment's integrity counters (kvgate's handoff
    /// mismatches; with a disaggregated vLLM, its NIXL failures and reads after expiry too);
    /// more than maxHandoffMismatches new counts in that time roll back to it. 0: no bake. An
    /// engine that moves no KV between pods has no counters and does not bake.
    #[serde(default = "bake_seconds")]
    #[schemars(range(min = 0, max = 86400))]
    pub bake_seconds: u64,
    /// New counts of the integrity counters (kvgate_handoff_mismatch_total, and a
    /// disaggregated vLLM's vllm:nixl_num_failed_transfers_total and
    /// vllm:nixl_num_notifications_after_expiry_total; every KV pod of the deployment) a bake
    /// tolerates before it rolls back. The canary tolerates none.
    #[serde(default)]
    pub max_handoff_mismatches: u64,
    /// The request that broke production, asked of every candidate pair or pod by the canary.
    #[serde(default)]
    pub boundary_probe: BoundaryProbeSpec,
}

impl Default for RolloutSpec {
    fn default() -> Self {
        RolloutSpec { canary: CanarySpec::default(), bake_seconds: bake_seconds(), max_handoff_mismatches: 0, boundary_probe: BoundaryProbeSpec::default() }
    }
}

/// Boundary probes: an engine must refuse what it cannot hold, never answer it 200. With the
/// canary on, every candidate pair or pod is sent a prompt of contextWindow + 1 tokens, which
/// must be refused with a 4xx; and, when the window is at most maxPromptTokens, a prompt of the
/// whole window (less canary.maxTokens), which must be served with the same tokens everywhere,
/// and one of contextWindow - 1 tokens asking for more, which must be refused or stop at the
/// window. An answer past the window (truncation, context shift, a placeholder for a rejected
/// prompt) refuses the revision: BoundaryProbeAnswered.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BoundaryProbeSpec {
    /// Whether the canary sends the probes.
    #[serde(default = "yes")]
    pub canary: bool,
    /// The longest window the probes prefill in full (tokens). A longer window gets only the
    /// contextWindow + 1 probe, which an honest engine refuses without computing anything.
    #[serde(default = "probe_max_prompt_tokens")]
    #[schemars(range(min = 1))]
    pub max_prompt_tokens: u64,
    /// The stale-KV probe (with the canary on): after the compared prompts, this many other
    /// prompts of canary.maxPromptTokens fill each pair's or pod's pool, as a tenant's traffic
    /// would, then every compared prompt must give the same tokens again; an engine that reads
    /// pages other requests wrote answers otherwise (CanaryFailed, "stale KV"). 0 turns it off.
    #[serde(default = "stale_kv_fillers")]
    #[schemars(range(min = 0, max = 64))]
    pub stale_kv_fillers: u32,
    /// Seconds between rounds of the probes on the serving revision's pairs or pods, beside
    /// their live traffic: a prompt of contextWindow + 1 tokens must still be refused with a
    /// 4xx, and a reference prompt must give what that pair or pod gave it the first time. A
    /// pod that fails leaves the Service (its gate) and the deployment is Degraded until a
    /// round passes again. 0 turns them off.
    #[serde(default = "serving_every_seconds")]
    #[schemars(range(min = 0, max = 86400))]
    pub serving_every_seconds: u64,
    /// The prompt tokens the serving rounds may have engines compute per hour, over the
    /// deployment's pods; a round that would exceed it is skipped. An engine that refuses the
    /// window + 1 probe computes nothing for it.
    #[serde(default = "max_prefill_tokens_per_hour")]
    #[schemars(range(min = 1))]
    pub max_prefill_tokens_per_hour: u64,
}

impl Default for BoundaryProbeSpec {
    fn default() -> Self {
        BoundaryProbeSpec {
            canary: true,
            max_prompt_tokens: probe_max_prompt_tokens(),
            stale_kv_fillers: stale_kv_fillers(),
            serving_every_seconds: serving_every_seconds(),
            max_prefill_tokens_per_hour: max_prefill_tokens_per_hour(),
        }
    }
}

fn serving_every_seconds() -> u64 {
    300
}

fn max_prefill_tokens_per_hour() -> u64 {
    1 << 20
}

fn stale_kv_fillers() -> u32 {
    4
}

fn yes() -> bool {
    true
}

fn probe_max_prompt_tokens() -> u64 {
    131_072
}

fn bake_seconds() -> u64 {
    300
}

/// The integrity canary: once every pod of a candidate revision measured a pool that holds the
/// window, the operator drives fixed greedy prompts through every candidate prefill x decode
/// pair over the same reserve -> prefill -> commit -> generate path the router uses. The revision
/// takes traffic only if every pair answers, every pair gives the same tokens for a prompt
/// (and, with the same model, the tokens the serving revision gives), and no candidate pod
/// counts a handoff mismatch; otherwise it is refused with reason `CanaryFailed`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CanarySpec {
    /// Prompts per pair, of lengths from one KV page up to maxPromptTokens. 0 turns the canary
    /// off (the pool check alone gates the revision).
    #[serde(default = "canary_prompts")]
    #[schemars(range(min = 0, max = 16))]
    pub prompts: u32,
    /// The longest canary prompt in tokens (capped at contextWindow - maxTokens).
    #[serde(default = "canary_max_prompt_tokens")]
    #[schemars(range(min = 1, max = 1048576))]
    pub max_prompt_tokens: u64,
    /// Tokens generated per prompt: the output every pair must agree on.
    #[serde(default = "canary_max_tokens")]
    #[schemars(range(min = 1, max = 256))]
    pub max_tokens: u32,
}

impl Default for CanarySpec {
    fn default() -> Self {
        CanarySpec { prompts: canary_prompts(), max_prompt_tokens: canary_max_prompt_tokens(), max_tokens: canary_max_tokens() }
    }
}

fn canary_prompts() -> u32 {
    3
}

fn canary_max_prompt_tokens() -> u64 {
    4096
}

fn canary_max_tokens() -> u32 {
    8
}

/// What the operator observed.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InferenceDeploymentStatus {
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Progressing, Canary (the integrity canary runs), Baking (promoted, the previous revision
    /// kept beside it), Available, Degraded (serving, with a serving pod out of the Service),
    /// RolledBack or Refused (for the printer column).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "optional::<Phase>")]
    pub phase: Option<Phase>,
    /// The reason of the condition that explains the phase, in one word (for the printer
    /// column): the refused revision's (e.g. KVPoolBelowContextWindow), Degraded's (e.g.
    /// ServingPodUnverified) or Progressing's (e.g. PodsCannotStart); absent when Available.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// `router/prefill/decode` ready pods of the serving revision, e.g. `1/2/2`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,
    /// Conditions, one per type: Available, Progressing, CapacityVerified, RolloutRefused,
    /// Degraded, PrefillWithinHandoffTimeout and, with spec.inferencePool, InferencePoolReady.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The last revision whose pods all passed the gate: the one serving.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_revision: Option<String>,
    /// The context window the serving revision was verified against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_context_window: Option<u64>,
    /// The revision being rolled out, while it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidate_revision: Option<String>,
    /// The last refused revision and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused_revision: Option<RefusedRevision>,
    /// The integrity canary's last run, for the revision it ran on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<CanaryStatus>,
    /// The bake in progress: the promoted revision, the previous one kept beside it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bake: Option<BakeStatus>,
    /// Prefill pods of the serving (or, before the first, the candidate) revision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<RoleStatus>,
    /// Decode pods, likewise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<RoleStatus>,
    /// Router pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<RoleStatus>,
    /// The external engine's server pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<RoleStatus>,
    /// Smallest measured per-request KV capacity among the shown revision's pods, any role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_measured_tokens: Option<u64>,
    /// The handoff Secret the operator created for this deployment (its name carries the
    /// UID). The operator may not read Secrets, so this is how a restarted operator knows it
    /// exists; a pod that reports it missing has it created again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handoff_secret: Option<String>,
}

/// A pod-spec type's full schema without its inner descriptions: `kubectl explain pod.spec` has
/// them, and with them the CRD would outgrow the 256 KiB that `kubectl apply` keeps of it in an
/// annotation.
fn terse<T: JsonSchema>(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
    fn strip(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(m) => {
                m.remove("description");
                m.values_mut().for_each(strip);
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let mut v = serde_json::to_value(T::json_schema(g)).expect("a schema is JSON");
    strip(&mut v);
    schemars::Schema::try_from(v).expect("still a schema")
}

/// A list of at most `MAX` Kubernetes objects, described tersely (see [`terse`]); string fields
/// get a length bound, so the API server can bound the cost of the CEL rules over them.
fn terse_list<T: JsonSchema, const MAX: usize>(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
    fn bound_strings(v: &mut serde_json::Value) {
        if let serde_json::Value::Object(m) = v {
            if m.get("type").and_then(|t| t.as_str()) == Some("string") && !m.contains_key("maxLength") {
                m.insert("maxLength".into(), 4096.into());
            }
            m.values_mut().for_each(bound_strings);
        }
    }
    let mut v = serde_json::to_value(terse::<Vec<T>>(g)).expect("a schema is JSON");
    bound_strings(&mut v);
    v["maxItems"] = MAX.into();
    schemars::Schema::try_from(v).expect("still a schema")
}

/// A role's extra volumes as the CRD describes them: each one's name and, for the hostPath
/// allowlist, a hostPath's path; the rest is kept as given, and the API server checks it when
/// the operator makes the pods. (Volume's whole schema, for four roles, would take the CRD past
/// the 256 KiB that client-side `kubectl apply` can annotate.)
fn volumes(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let string = serde_json::json!({ "type": "string", "maxLength": 4096 });
    let v = serde_json::json!({
        "type": "array",
        "maxItems": 32,
        "items": {
            "type": "object",
            "required": ["name"],
            "x-kubernetes-preserve-unknown-fields": true,
            "properties": {
                "name": { "type": "string", "maxLength": 63 },
                "hostPath": { "type": "object", "required": ["path"], "properties": { "path": string, "type": string } },
            },
        },
    });
    schemars::Schema::try_from(v).expect("a schema")
}

/// An optional closed set (`Option<Phase>`, ...) as a structural schema: the enum, nullable
/// (schemars would list `null` among the enum's values, which the API server refuses).
fn optional<T: JsonSchema>(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let mut s = T::json_schema(g);
    s.insert("nullable".into(), true.into());
    s
}

/// A revision the rollout gate refused.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RefusedRevision {
    /// The refused revision (a hash of everything that shapes its pods).
    pub revision: String,
    /// KVPoolBelowContextWindow, FingerprintMismatch, CanaryFailed, BoundaryProbeAnswered,
    /// HandoffIntegrityViolation (integrity counters moved during the canary, or during a bake
    /// that was rolled back) or HostPathNotAllowed.
    pub reason: RefusalReason,
    /// With the pod and both numbers, e.g. `prefill pod x measured 681280 tokens < contextWindow 1048576`.
    pub message: String,
    /// It served and was rolled back in its bake (phase RolledBack); a revision refused before
    /// it served (phase Refused) leaves it out.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rolled_back: bool,
}

/// A bake in progress.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BakeStatus {
    /// The revision that was promoted and is baking.
    pub revision: String,
    /// The revision it replaced, kept at its size until the bake ends.
    pub previous: String,
    /// The window the previous revision was verified for (restored on rollback).
    pub previous_context_window: u64,
    /// When the bake started.
    pub started_at: Time,
    /// The deployment's handoff mismatch counters (summed) when it started.
    pub mismatches_at_start: u64,
}

/// What the integrity canary found for one revision.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CanaryStatus {
    /// The revision the canary ran on.
    pub revision: String,
    /// Whether every pair answered, agreed, counted no mismatch and refused past the window.
    pub passed: bool,
    /// What ran and what it found (the failing pair, prompt length and first differing token).
    pub message: String,
    /// Why it failed: CanaryFailed, or BoundaryProbeAnswered (an answer past the window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "optional::<RefusalReason>")]
    pub reason: Option<RefusalReason>,
}

/// Pods of one role.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RoleStatus {
    /// The revision these numbers are of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// Pods the spec asks for.
    pub desired_replicas: i32,
    /// Pods whose readiness probe passes.
    pub ready_replicas: i32,
    /// Pods whose KV pool passed the gate.
    #[serde(default)]
    pub verified_replicas: i32,
    /// Smallest measured KV pool among the pods (tokens).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_measured_tokens: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The operator caches every InferenceDeployment it watches (1,010 of them in the operator
    /// bench): a pod-spec type held inline in a role (a `Container` is 2.3 KB, absent or not)
    /// costs that much per deployment. Box such fields.
    #[test]
    fn an_inference_deployment_holds_no_pod_spec_type_inline() {
        let size = std::mem::size_of::<InferenceDeployment>();
        assert!(size < 4096, "InferenceDeployment is {size} bytes inline: box the large optional fields of its spec");
    }
}
