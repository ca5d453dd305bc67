//! Registers a Node, keeps its Lease and Ready condition fresh, runs the containers of the pods
//! kube-scheduler binds to it as OCI containers with runc (see `pod`; each pod in its own network
//! namespace, see `network`, and cgroup, see `cgroups`), reports their status, serves their logs on the kubelet's port
//! (`kubelet_api`) and answers their DNS questions about Services (`dns`).

use std::collections::{BTreeSet, HashMap};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, NodeSpec, Pod, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

use super::cgroups::{self, Cgroups};
use super::images::ImageTable;
use super::kubelet_api::{self, KubeletTls};
use super::logs::LogIndex;
use super::network::PodNetwork;
use super::oci_image::ImageStore;
use super::pod::{PodRt, Runtime};
use super::pull::Puller;
use super::runc::Runc;

#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub node_name: String,
    pub images: ImageTable,
    /// Registries (`host:port`) pulled from over plain HTTP; every other one needs TLS.
    pub insecure_registries: Vec<String>,
    /// `REGISTRY=MIRROR`: images of REGISTRY are pulled from MIRROR (same repository paths).
    pub registry_mirrors: Vec<String>,
    /// Where pods' logs and kubeconfigs live.
    pub dir: PathBuf,
    /// API server URL and CA file written into pods' kubeconfigs (an address pods reach).
    pub server: String,
    pub ca_file: PathBuf,
    /// The CNI plugins (bridge, host-local, loopback).
    pub cni_bin: PathBuf,
    /// The kubelet API's serving certificate and key (PEM); clients must be signed by `ca_file`.
    pub kubelet_cert: PathBuf,
    pub kubelet_key: PathBuf,
    /// The node's address (its InternalIP, where the API server dials its kubelet API) and
    /// the CIDR its pods get addresses from.
    pub node_ip: Ipv4Addr,
    pub pod_cidr: String,
    /// What the scheduler may place here (`allocatable`), e.g. "8", "16Gi" and "100Gi": a
    /// resource a node does not report is one it has none of.
    pub cpu: String,
    pub memory: String,
    pub ephemeral_storage: String,
    /// How often the Lease is renewed and the Ready condition posted (a kubelet's is 10 s).
    pub heartbeat: Duration,
}

/// Secret volumes are refreshed every this many sync rounds of 200 ms (2 s; a kubelet watches
/// its pods' Secrets and updates volumes within its sync period).
const SECRET_REFRESH_ROUNDS: u64 = 10;

pub struct NodeAgent {
    client: kube::Client,
    cfg: AgentConfig,
    pods: HashMap<String, PodRt>,
    network: PodNetwork,
    /// The parent of the pods' cgroups, or why limits cannot be enforced on this machine.
    cgroups: Result<Cgroups, String>,
    runtime: Runtime,
    logs: LogIndex,
    /// Where the kubelet API listens (advertised in the Node's `daemonEndpoints`).
    kubelet_port: u16,
}

const MANAGER: &str = "kvgate-node-agent";

impl NodeAgent {
    /// Fails when pods cannot be networked here (no CNI plugins). Without a writable memory
    /// controller it says so once and refuses only pods that set limits.
    pub fn new(client: kube::Client, cfg: AgentConfig) -> anyhow::Result<Self> {
        let network = PodNetwork::new(cfg.cni_bin.clone(), &cfg.dir, &cfg.pod_cidr, cfg.node_ip)?;
        let cgroups = Cgroups::new().map_err(|e| format!("{e:#}"));
        if let Err(e) = &cgroups {
            tracing::warn!(error = e, "pod resource limits cannot be enforced on this machine; pods that set limits will not start");
        }
        let runc = Runc::new(cfg.dir.join("runc"));
        if let Err(e) = &runc {
            tracing::warn!(error = e, "containers of OCI images will not start");
        }
        let puller = Puller::new(cfg.dir.join("pulled"), cfg.insecure_registries.clone(), &cfg.registry_mirrors).map_err(anyhow::Error::msg)?;
        let runtime = Runtime { images: cfg.images.clone(), puller, store: ImageStore::new(cfg.dir.join("images")), runc };
        Ok(NodeAgent { client, cfg, pods: HashMap::new(), network, cgroups, runtime, logs: LogIndex::default(), kubelet_port: 0 })
    }

    async fn register(&self) -> anyhow::Result<()> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let name = &self.cfg.node_name;
        if nodes.get_opt(name).await?.is_none() {
            let node = Node {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    labels: Some([("kubernetes.io/hostname".to_string(), name.clone()), ("kubernetes.io/os".to_string(), "linux".to_string())].into()),
                    ..Default::default()
                },
                spec: Some(NodeSpec { pod_cidr: Some(self.cfg.pod_cidr.clone()), pod_cidrs: Some(vec![self.cfg.pod_cidr.clone()]), ..Default::default() }),
                ..Default::default()
            };
            nodes.create(&PostParams::default(), &node).await?;
        }
        heartbeat(&self.client, &self.cfg, self.kubelet_port).await
    }

    /// Runs until the process is stopped.
    pub async fn run(mut self) -> anyhow::Result<()> {
        // Every address of the node's namespace: the API server dials its InternalIP.
        let tls = KubeletTls { cert: &self.cfg.kubelet_cert, key: &self.cfg.kubelet_key, client_ca: &self.cfg.ca_file };
        self.kubelet_port = kubelet_api::serve(([0, 0, 0, 0], 0).into(), tls, self.logs.clone()).await?.port();
        self.register().await?;
        // The pods' cluster DNS, on every address of the node's namespace (the pods' gateway
        // among them); without it names of Services do not resolve in pods, and nothing else.
        let client = self.client.clone();
        tokio::spawn(async move {
            if let Err(e) = super::dns::serve(client, ([0, 0, 0, 0], 53).into()).await {
                tracing::warn!(error = %e, "the pods' DNS stopped; names of Services do not resolve in pods");
            }
        });
        // Its own task: a pod sync that waits (a terminating pod's grace period) never delays
        // a heartbeat, or the node would go NotReady while it stops a pod.
        let (client, cfg, port) = (self.client.clone(), self.cfg.clone(), self.kubelet_port);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(cfg.heartbeat).await;
                if let Err(e) = heartbeat(&client, &cfg, port).await {
                    tracing::warn!(error = %e, "node heartbeat failed");
                }
            }
        });
        for round in 0u64.. {
            match self.sync().await {
                Err(e) => tracing::warn!(error = %e, "pod sync failed"),
                Ok(pods) if round % SECRET_REFRESH_ROUNDS == 0 => self.refresh_secrets(&pods).await,
                Ok(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        unreachable!("the loop runs for ever")
    }

    /// One pass over this node's pods; returns them as listed.
    async fn sync(&mut self) -> anyhow::Result<Vec<Pod>> {
        let all: Api<Pod> = Api::all(self.client.clone());
        let mine = all.list(&ListParams::default().fields(&format!("spec.nodeName={}", self.cfg.node_name))).await?.items;
        let mut seen = BTreeSet::new();
        for pod in &mine {
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            seen.insert(uid.clone());
            if pod.metadata.deletion_timestamp.is_some() {
                self.terminate(pod).await;
                continue;
            }
            if !self.pods.contains_key(&uid) {
                match self.admit(pod).await {
                    Ok(rt) => self.pods.insert(uid.clone(), rt),
                    Err(e) => {
                        tracing::warn!(pod = pod.metadata.name, error = %e, "cannot start pod; retrying");
                        continue;
                    }
                };
            }
            let automount = pod.spec.as_ref().and_then(|s| s.automount_service_account_token) != Some(false);
            if automount && self.pods[&uid].token.is_none() {
                let dir = self.pods[&uid].dir().to_path_buf();
                if let Some((token, kubeconfig)) = self.retry_token(pod, &dir).await {
                    self.pods.get_mut(&uid).unwrap().set_token(token, kubeconfig);
                }
            }
            let rt = self.pods.get_mut(&uid).unwrap();
            if rt.volumes_missing() {
                rt.set_volumes(super::volumes::prepare(&self.client, pod, rt.dir(), rt.token.as_deref()).await);
            }
            if rt.secret_env_missing() {
                rt.set_secret_env(super::env::secret_values(&self.client, pod).await);
            }
            rt.tick(pod, &self.runtime).await;
            let (ns, name) = (pod.metadata.namespace.as_deref().unwrap_or("default"), pod.metadata.name.as_deref().unwrap_or_default());
            self.logs.update(ns, name, &uid, rt.dir(), rt.running());
            let status = rt.status(pod);
            if rt.last_status.as_ref() != Some(&status) {
                let api: Api<Pod> = Api::namespaced(self.client.clone(), pod.metadata.namespace.as_deref().unwrap_or("default"));
                let name = pod.metadata.name.clone().unwrap_or_default();
                match api.patch_status(&name, &PatchParams::default(), &Patch::Strategic(json!({ "status": status }))).await {
                    Ok(_) => rt.last_status = Some(status),
                    Err(e) => tracing::warn!(pod = name, error = %e, "status update failed"),
                }
            }
        }
        // Pods removed behind our back: stop their processes.
        let gone: Vec<String> = self.pods.keys().filter(|u| !seen.contains(*u)).cloned().collect();
        for uid in gone {
            self.logs.remove(&uid);
            if let Some(rt) = self.pods.remove(&uid) {
                rt.tear_down(Duration::from_secs(1), &self.network);
            }
        }
        Ok(mine)
    }

    /// Running pods' Secret volumes brought up to date with their Secrets (`pods`: this node's,
    /// as the sync pass just listed them).
    async fn refresh_secrets(&self, pods: &[Pod]) {
        let mut secrets = super::volumes::SecretCache::new();
        for pod in pods {
            let Some(rt) = pod.metadata.uid.as_ref().and_then(|u| self.pods.get(u)) else { continue };
            if let Err(e) = super::volumes::refresh_secrets(&self.client, pod, rt.dir(), &mut secrets).await {
                tracing::warn!(pod = pod.metadata.name, error = %e, "secret volume not refreshed");
            }
        }
    }

    /// A new pod: its network namespace, cgroup, directory, and a kubeconfig with its service
    /// account's token.
    async fn admit(&mut self, pod: &Pod) -> anyhow::Result<PodRt> {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let dir = self.cfg.dir.join(&uid);
        let _ = std::fs::create_dir_all(&dir);
        let cgroup = match (cgroups::pod_limits(pod), &self.cgroups) {
            (Err(e), _) => Err(e),
            (Ok(limits), Ok(cg)) => Some(cg.pod(&uid, limits).map_err(|e| format!("{e:#}"))).transpose(),
            (Ok(limits), Err(why)) if limits != cgroups::Limits::default() => Err(format!("resources.limits cannot be enforced: {why}")),
            (Ok(_), Err(_)) => Ok(None),
        };
        let sandbox = self.network.add(&uid)?;
        let token = match self.token(pod).await {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "service account token request failed");
                None
            }
        };
        let kubeconfig = match &token {
            Some(token) => self.kubeconfig(pod, &dir, token)?,
            None => None,
        };
        let volumes = super::volumes::prepare(&self.client, pod, &dir, token.as_deref()).await;
        Ok(PodRt::new(pod, sandbox, cgroup, dir, kubeconfig, token, volumes))
    }

    /// Writes the pod's kubeconfig (the API server as pods reach it, the pod's token).
    fn kubeconfig(&self, pod: &Pod, dir: &std::path::Path, token: &str) -> anyhow::Result<Option<PathBuf>> {
        use base64::Engine;
        let path = dir.join("kubeconfig");
        let ca = std::fs::read(&self.cfg.ca_file)?;
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {}\n    certificate-authority-data: {}\nusers:\n- name: sa\n  user:\n    token: {token}\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: sa\n    namespace: {}\ncurrent-context: c\n",
            self.cfg.server,
            base64::engine::general_purpose::STANDARD.encode(ca),
            pod.metadata.namespace.as_deref().unwrap_or("default"),
        );
        Ok(std::fs::write(&path, text).ok().map(|_| path))
    }

    /// A token and kubeconfig for a pod whose token request failed when it was admitted (the
    /// API server was unreachable): asked again on every pass until it has one, as the kubelet
    /// does.
    async fn retry_token(&self, pod: &Pod, dir: &std::path::Path) -> Option<(String, Option<PathBuf>)> {
        let token = self.token(pod).await.ok().flatten()?;
        let kubeconfig = self.kubeconfig(pod, dir, &token).ok().flatten();
        Some((token, kubeconfig))
    }

    async fn token(&self, pod: &Pod) -> anyhow::Result<Option<String>> {
        let spec = pod.spec.as_ref();
        if spec.and_then(|s| s.automount_service_account_token) == Some(false) {
            return Ok(None);
        }
        let sa = spec.and_then(|s| s.service_account_name.clone()).unwrap_or_else(|| "default".into());
        let api: Api<ServiceAccount> = Api::namespaced(self.client.clone(), pod.metadata.namespace.as_deref().unwrap_or("default"));
        let req = TokenRequest { spec: Some(TokenRequestSpec { expiration_seconds: Some(3600), ..Default::default() }), ..Default::default() };
        let resp: TokenRequest = api.create_subresource("token", &sa, &PostParams::default(), &req).await?;
        Ok(resp.status.and_then(|s| s.token))
    }

    async fn terminate(&mut self, pod: &Pod) {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let grace = pod.spec.as_ref().and_then(|s| s.termination_grace_period_seconds).unwrap_or(30).max(0) as u64;
        self.logs.remove(&uid);
        if let Some(rt) = self.pods.remove(&uid) {
            tokio::task::block_in_place(|| rt.tear_down(Duration::from_secs(grace), &self.network));
        }
        let api: Api<Pod> = Api::namespaced(self.client.clone(), pod.metadata.namespace.as_deref().unwrap_or("default"));
        let name = pod.metadata.name.clone().unwrap_or_default();
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(kube::api::Preconditions { uid: Some(uid), resource_version: None }),
            ..Default::default()
        };
        if let Err(e) = api.delete(&name, &dp).await {
            tracing::debug!(pod = name, error = %e, "final delete failed");
        }
    }
}

impl Drop for NodeAgent {
    /// On SIGTERM: every pod's processes, address, namespace and cgroup go with the agent.
    fn drop(&mut self) {
        for (_, rt) in self.pods.drain() {
            rt.tear_down(Duration::from_secs(1), &self.network);
        }
    }
}

/// Posts the Node's Ready status and renews its Lease.
async fn heartbeat(client: &kube::Client, cfg: &AgentConfig, kubelet_port: u16) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let now = Timestamp::now();
    let resources = json!({ "cpu": cfg.cpu, "memory": cfg.memory, "ephemeral-storage": cfg.ephemeral_storage, "pods": "110" });
    let status = json!({ "status": {
        "capacity": resources,
        "allocatable": resources,
        "addresses": [{ "type": "InternalIP", "address": cfg.node_ip.to_string() }, { "type": "Hostname", "address": cfg.node_name }],
        "daemonEndpoints": { "kubeletEndpoint": { "Port": kubelet_port } },
        "conditions": [{ "type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kvgate node agent is posting ready status",
                         "lastHeartbeatTime": now, "lastTransitionTime": now }],
        "nodeInfo": { "kubeletVersion": "v1.37.2-kvgate", "containerRuntimeVersion": "kvgate-local://1", "operatingSystem": "linux",
                      "architecture": std::env::consts::ARCH, "kernelVersion": "", "osImage": "", "kubeProxyVersion": "",
                      "machineID": "", "systemUUID": "", "bootID": "" },
    }});
    nodes.patch_status(&cfg.node_name, &PatchParams::default(), &Patch::Merge(&status)).await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let lease = json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": { "name": cfg.node_name },
        "spec": { "holderIdentity": cfg.node_name, "leaseDurationSeconds": 4 * cfg.heartbeat.as_secs().max(1), "renewTime": MicroTime(now) },
    });
    leases.patch(&cfg.node_name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(&lease)).await?;
    Ok(())
}
