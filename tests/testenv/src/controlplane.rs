//! etcd, kube-apiserver, kube-controller-manager and kube-scheduler on free ports, one set per
//! test binary, in the binary's own network namespace (`netns`), with a kubeconfig for an admin
//! in `system:masters`, and node agents each on a machine of its own (`fabric`). The API server
//! listens on every address of the world's namespace: the tests dial 127.0.0.1, nodes and pods
//! the world's address on the fabric.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::bail;

use crate::certs::{self, Certs};
use crate::fabric::{self, Machine};
use crate::netns;
use crate::nodes::{Node, Resources};
use crate::process::{Proc, free_port, tail};

/// How often node agents renew their Lease, and how long kube-controller-manager waits without
/// one before it marks the Node NotReady (a kubelet's defaults are 10 s and 50 s): a node lost in
/// a test is noticed in seconds. Its pods are then evicted once their `unreachable` toleration
/// runs out (the operator renders 30 s for kvgate's pods).
pub const NODE_HEARTBEAT_SECS: u64 = 2;
pub const NODE_MONITOR_GRACE_SECS: u64 = 16;

/// Where `make controlplane` puts the binaries (override with `KVGATE_CONTROLPLANE_BIN`).
pub fn bin_dir() -> PathBuf {
    std::env::var_os("KVGATE_CONTROLPLANE_BIN").map(PathBuf::from).unwrap_or_else(|| crate::paths::target("controlplane/bin"))
}

fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let p = bin_dir().join(name);
    if !p.is_file() {
        bail!("{} not found: build the control plane with `make controlplane` (tests/controlplane/build.sh)", p.display());
    }
    Ok(p)
}

/// A control plane's directory is `kvgate-cp-<pid of the process that started it>-<port>`.
const DIR_PREFIX: &str = "kvgate-cp-";

/// Removes the directories of control planes whose process has exited. A test binary's shared
/// control plane is never dropped (a static), and each holds etcd's preallocated WAL and the
/// node's unpacked images (hundreds of MB): without this, every run left them in the temp
/// directory until the disk filled and etcd could not start.
fn sweep_dirs(tmp: &Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let owner = name.to_str().and_then(|n| n.strip_prefix(DIR_PREFIX)).and_then(|rest| rest.split('-').next()).and_then(|p| p.parse::<i32>().ok());
        if owner.is_some_and(|pid| !crate::process::alive(pid)) {
            tracing::info!(dir = %entry.path().display(), "removing the directory of a control plane whose process exited");
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// What a control plane starts with besides its components.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Apply `crds/` before kube-controller-manager starts, as in a cluster the operator is
    /// installed into. Its garbage collector discovers new resource types only every 30 s, and
    /// never collects the dependents of an owner deleted before it watched the owner's type,
    /// which a test that deletes right after it creates would meet.
    pub crds: bool,
    /// Write the API server's audit log (every request's metadata: user, user agent, verb,
    /// resource; `audit_log()`), for benchmarks that count who asks what.
    pub audit: bool,
}

#[derive(Debug)]
pub struct ControlPlane {
    pub dir: PathBuf,
    pub kubeconfig: PathBuf,
    pub server: String,
    pub certs: Certs,
    procs: Mutex<Vec<Proc>>,
    /// Each node name's machine index (a node started again under its name gets its address and
    /// pod CIDR back).
    machines: Mutex<BTreeMap<String, u8>>,
}

fn wait_until(what: &str, timeout: Duration, mut ready: impl FnMut() -> anyhow::Result<bool>) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if ready()? {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    bail!("{what} did not become ready within {timeout:?}")
}

impl ControlPlane {
    /// The control plane shared by every test of this binary, started on first use, with kvgate's
    /// CRDs installed before its controllers start.
    pub fn shared() -> &'static ControlPlane {
        Self::shared_with(Options { crds: true, audit: false })
    }

    /// The shared control plane, started with `options` if this is the first use (a bench that
    /// needs the audit log calls this before anything else starts it).
    pub fn shared_with(options: Options) -> &'static ControlPlane {
        static CP: OnceLock<ControlPlane> = OnceLock::new();
        CP.get_or_init(|| ControlPlane::start_with(options).unwrap_or_else(|e| panic!("starting the test control plane: {e:#}")))
    }

    /// A control plane without kvgate's CRDs (the dev cluster installs them with the chart).
    pub fn start() -> anyhow::Result<ControlPlane> {
        Self::start_with(Options::default())
    }

    pub fn start_with(options: Options) -> anyhow::Result<ControlPlane> {
        netns::require()?;
        netns::sweep();
        sweep_dirs(&std::env::temp_dir());
        let started = Instant::now();
        let dir = std::env::temp_dir().join(format!("{DIR_PREFIX}{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir)?;
        let certs = certs::generate(&dir)?;
        let (client, peer, secure) = (free_port(), free_port(), free_port());
        let server = format!("https://127.0.0.1:{secure}");
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(&kubeconfig, kubeconfig_text(&server, &certs))?;
        let cp = ControlPlane { dir: dir.clone(), kubeconfig, server, certs, procs: Mutex::new(Vec::new()), machines: Mutex::new(BTreeMap::new()) };
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let path = |p: &Path| p.display().to_string();

        let etcd = Proc::spawn(
            "etcd",
            &binary("etcd")?,
            &s(&[
                "--name=kvgate",
                &format!("--data-dir={}", dir.join("etcd").display()),
                &format!("--listen-client-urls=http://127.0.0.1:{client}"),
                &format!("--advertise-client-urls=http://127.0.0.1:{client}"),
                &format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
                &format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"),
                &format!("--initial-cluster=kvgate=http://127.0.0.1:{peer}"),
                "--unsafe-no-fsync",
                "--log-level=warn",
            ]),
            &dir,
        )?;
        cp.procs.lock().unwrap().push(etcd);

        let mut audit = Vec::new();
        if options.audit {
            let policy = dir.join("audit-policy.yaml");
            std::fs::write(&policy, "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n- level: Metadata\n")?;
            audit = vec![format!("--audit-policy-file={}", path(&policy)), format!("--audit-log-path={}", path(&cp.audit_log()))];
        }
        let apiserver = Proc::spawn(
            "kube-apiserver",
            &binary("kube-apiserver")?,
            &[
                s(&[
                    &format!("--etcd-servers=http://127.0.0.1:{client}"),
                    "--bind-address=0.0.0.0",
                    &format!("--advertise-address={}", fabric::WORLD),
                    &format!("--secure-port={secure}"),
                    &format!("--tls-cert-file={}", path(&cp.certs.server_cert)),
                    &format!("--tls-private-key-file={}", path(&cp.certs.server_key)),
                    &format!("--client-ca-file={}", path(&cp.certs.ca)),
                    "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                    &format!("--service-account-key-file={}", path(&cp.certs.sa_pub)),
                    &format!("--service-account-signing-key-file={}", path(&cp.certs.sa_key)),
                    "--service-cluster-ip-range=10.96.0.0/16",
                    "--authorization-mode=RBAC",
                    // Node agents' kubelet API (kubectl logs): dialled at the Node's InternalIP,
                    // its certificate checked against the cluster CA.
                    "--kubelet-preferred-address-types=InternalIP",
                    &format!("--kubelet-certificate-authority={}", path(&cp.certs.ca)),
                    &format!("--kubelet-client-certificate={}", path(&cp.certs.kubelet_client_cert)),
                    &format!("--kubelet-client-key={}", path(&cp.certs.kubelet_client_key)),
                    // Pods get the API server's address in their kubeconfig; no kube-proxy runs
                    // to make the kubernetes Service's ClusterIP reachable.
                    "--endpoint-reconciler-type=none",
                    "--v=1",
                ]),
                audit,
            ]
            .concat(),
            &dir,
        )?;
        cp.procs.lock().unwrap().push(apiserver);
        wait_until("kube-apiserver", Duration::from_secs(90), || {
            cp.check_alive()?;
            Ok(cp.kubectl(&["get", "--raw", "/readyz"]).status.success())
        })?;

        if options.crds {
            let crds = crate::paths::root().join("crds");
            let out = cp.kubectl(&["apply", "-f", &path(&crds)]);
            if !out.status.success() {
                bail!("applying {}: {}", crds.display(), String::from_utf8_lossy(&out.stderr));
            }
        }
        let admin = path(&cp.kubeconfig);
        let kcm = Proc::spawn(
            "kube-controller-manager",
            &binary("kube-controller-manager")?,
            &s(&[
                &format!("--kubeconfig={admin}"),
                &format!("--authentication-kubeconfig={admin}"),
                &format!("--authorization-kubeconfig={admin}"),
                // No HTTPS endpoint (nothing reads its health or metrics): a port picked at the
                // start and bound seconds later was taken meanwhile by one of the apiserver's
                // own connections once (CI: "bind: address already in use").
                "--secure-port=0",
                "--leader-elect=false",
                &format!("--service-account-private-key-file={}", path(&cp.certs.sa_key)),
                &format!("--root-ca-file={}", path(&cp.certs.ca)),
                &format!("--cluster-signing-cert-file={}", path(&cp.certs.ca)),
                &format!("--cluster-signing-key-file={}", path(&cp.certs.ca_key)),
                "--use-service-account-credentials=true",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--concurrent-deployment-syncs=10",
                "--node-monitor-period=2s",
                &format!("--node-monitor-grace-period={NODE_MONITOR_GRACE_SECS}s"),
                "--v=1",
            ]),
            &dir,
        )?;
        cp.procs.lock().unwrap().push(kcm);
        let scheduler = Proc::spawn(
            "kube-scheduler",
            &binary("kube-scheduler")?,
            &s(&[
                &format!("--kubeconfig={admin}"),
                &format!("--authentication-kubeconfig={admin}"),
                &format!("--authorization-kubeconfig={admin}"),
                "--secure-port=0",
                "--leader-elect=false",
                "--v=1",
            ]),
            &dir,
        )?;
        cp.procs.lock().unwrap().push(scheduler);
        // The controller manager is up once it has made the default ServiceAccount.
        wait_until("kube-controller-manager", Duration::from_secs(60), || {
            cp.check_alive()?;
            Ok(cp.kubectl(&["get", "serviceaccount", "default", "-n", "default"]).status.success())
        })?;
        eprintln!("kvgate-testenv: control plane ready at {} in {:.1?} ({})", cp.server, started.elapsed(), cp.dir.display());
        Ok(cp)
    }

    /// Stops kube-apiserver and starts it again (same ports, same etcd), waiting until it is
    /// ready: every client sees its connections drop and its watches end.
    pub fn restart_apiserver(&self) -> anyhow::Result<()> {
        {
            let mut procs = self.procs.lock().unwrap();
            let apiserver = procs.iter_mut().find(|p| p.name == "kube-apiserver").expect("the control plane runs kube-apiserver");
            apiserver.restart()?;
        }
        wait_until("kube-apiserver after its restart", Duration::from_secs(90), || {
            self.check_alive()?;
            Ok(self.kubectl(&["get", "--raw", "/readyz"]).status.success())
        })
    }

    fn check_alive(&self) -> anyhow::Result<()> {
        for p in self.procs.lock().unwrap().iter_mut() {
            p.check_alive()?;
        }
        Ok(())
    }

    /// Runs the real `kubectl` against this control plane.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        Command::new(kubectl_path())
            .arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .args(args)
            .output()
            .expect("kubectl not found: build it with `make controlplane` (or set KUBECTL=/path/to/kubectl)")
    }

    /// Runs `kubectl` authenticated only by `token` (no admin certificate).
    pub fn kubectl_as(&self, token: &str, args: &[&str]) -> Output {
        Command::new(kubectl_path())
            .arg("--kubeconfig=/dev/null")
            .arg(format!("--server={}", self.server))
            .arg(format!("--certificate-authority={}", self.certs.ca.display()))
            .arg(format!("--token={token}"))
            .args(args)
            .output()
            .expect("kubectl not found: build it with `make controlplane` (or set KUBECTL=/path/to/kubectl)")
    }

    /// `kubectl` that must succeed; returns its stdout.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args);
        assert!(out.status.success(), "kubectl {args:?} failed:\n{}\n{}", String::from_utf8_lossy(&out.stderr), self.logs());
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A new namespace for one test, with its default ServiceAccount in place.
    pub fn namespace(&self, prefix: &str) -> String {
        let name = format!("{prefix}-{:06x}", rand_suffix());
        self.kubectl_ok(&["create", "namespace", &name]);
        let _ = wait_until("the namespace's default ServiceAccount", Duration::from_secs(30), || {
            Ok(self.kubectl(&["get", "serviceaccount", "default", "-n", &name]).status.success())
        });
        name
    }

    /// A fresh namespace where the API server's PodSecurity admission enforces the `restricted`
    /// profile: a pod that is not (non-root, no privilege escalation, every capability dropped,
    /// seccomp `RuntimeDefault`) is refused at creation.
    pub fn restricted_namespace(&self, prefix: &str) -> String {
        let name = self.namespace(prefix);
        self.kubectl_ok(&["label", "namespace", &name, "pod-security.kubernetes.io/enforce=restricted", "pod-security.kubernetes.io/enforce-version=latest"]);
        name
    }

    /// The API server as nodes and pods reach it: the world's address on the fabric.
    pub fn pod_server(&self) -> String {
        self.server.replace("127.0.0.1", &fabric::WORLD.to_string())
    }

    /// Starts node `node` with the default resources: see `node_agent_with`.
    pub fn node_agent(&self, agent: &Path, node: &str, images: &[(String, String)]) -> anyhow::Result<Node> {
        self.node_agent_with(agent, node, images, &Resources::default())
    }

    /// Starts a node agent (`kvgate-node-agent` at `agent`) on a machine of its own
    /// (`fabric::Machine`), offering `resources` to the scheduler and running pods whose images
    /// are pre-loaded in `images` (name, then `oci:LAYOUT:TAG` or a host binary's path; see
    /// `node::images`) or pulled from the world's registry (`registry`).
    /// Returns once the Node is Ready. Its pods' files (logs, `network.json`, bundles) are under
    /// `node_dir(node)`. A node started again under a name it had gets its machine's address
    /// and pod CIDR back.
    pub fn node_agent_with(&self, agent: &Path, node: &str, images: &[(String, String)], resources: &Resources) -> anyhow::Result<Node> {
        let index = {
            let mut machines = self.machines.lock().unwrap();
            let next = machines.len() as u8 + 1;
            *machines.entry(node.to_string()).or_insert(next)
        };
        let machine = Machine::start(index)?;
        let pod_cidr = fabric::pod_cidr(index);
        // The admin's kubeconfig names 127.0.0.1, which inside the machine is its own loopback.
        let kubeconfig = self.dir.join(format!("{node}.kubeconfig"));
        std::fs::write(&kubeconfig, std::fs::read_to_string(&self.kubeconfig)?.replace(&self.server, &self.pod_server()))?;
        let mut args = vec![
            format!("--net={}", machine.netns.display()),
            agent.display().to_string(),
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--server={}", self.pod_server()),
            format!("--ca-file={}", self.certs.ca.display()),
            format!("--kubelet-cert={}", self.certs.kubelet_cert.display()),
            format!("--kubelet-key={}", self.certs.kubelet_key.display()),
            format!("--cni-bin={}", crate::node::network::default_bin_dir().display()),
            format!("--node-name={node}"),
            format!("--dir={}", self.node_dir(node).display()),
            format!("--node-ip={}", machine.ip),
            format!("--pod-cidr={pod_cidr}"),
            format!("--cpu={}", resources.cpu),
            format!("--memory={}", resources.memory),
            format!("--ephemeral-storage={}", resources.ephemeral_storage),
            format!("--heartbeat-seconds={NODE_HEARTBEAT_SECS}"),
        ];
        for (name, path) in images {
            args.push("--image".into());
            args.push(format!("{name}={path}"));
        }
        // Every other image is pulled from the world's registry, ghcr.io's mirror here.
        args.extend(crate::registry::node_flags());
        // nsenter (util-linux) execs the agent inside the machine's namespace, in the process
        // group Proc gives it: killing that group is the machine losing power.
        let mut p = Proc::spawn(node, Path::new("nsenter"), &args, &self.dir)?;
        wait_until("the node agent's Node to be Ready", Duration::from_secs(60), || {
            p.check_alive()?;
            Ok(self.node_ready(node) == Some(true))
        })?;
        Ok(Node::new(node, self.node_dir(node), p, machine))
    }

    /// The Node's Ready condition (`None` while there is no such Node or no condition).
    pub fn node_ready(&self, node: &str) -> Option<bool> {
        let out = self.kubectl(&["get", "node", node, "-o", "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}"]);
        match String::from_utf8_lossy(&out.stdout).trim() {
            "True" => Some(true),
            "False" | "Unknown" => Some(false),
            _ => None,
        }
    }

    /// The API server's audit log (with `Options::audit`): one JSON event per line.
    pub fn audit_log(&self) -> PathBuf {
        self.dir.join("audit.log")
    }

    /// Where node `node`'s agent keeps its pods' files (one directory per pod UID).
    pub fn node_dir(&self, node: &str) -> PathBuf {
        self.dir.join(node)
    }

    /// A kube client for the admin identity.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        let kc = kube::config::Kubeconfig::read_from(&self.kubeconfig)?;
        let config = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
        Ok(kube::Client::try_from(config)?)
    }

    /// The tail of every component's log, for a failed test's output.
    pub fn logs(&self) -> String {
        self.procs.lock().unwrap().iter().map(|p| format!("--- {} ({}) ---\n{}", p.name, p.log.display(), tail(&p.log, 30))).collect::<Vec<_>>().join("\n")
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        for mut p in self.procs.lock().unwrap().drain(..).rev() {
            p.stop();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `kubectl` built with the control plane (`make controlplane`), or `KUBECTL`.
pub fn kubectl_path() -> PathBuf {
    std::env::var_os("KUBECTL").map(PathBuf::from).unwrap_or_else(|| bin_dir().join("kubectl"))
}

fn rand_suffix() -> u32 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now()) as u32 & 0xff_ffff
}

fn kubeconfig_text(server: &str, certs: &Certs) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: kvgate-test\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\nusers:\n- name: admin\n  user:\n    client-certificate: {cert}\n    client-key: {key}\ncontexts:\n- name: kvgate-test\n  context:\n    cluster: kvgate-test\n    user: admin\ncurrent-context: kvgate-test\n",
        ca = certs.ca.display(),
        cert = certs.admin_cert.display(),
        key = certs.admin_key.display(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_directories_of_exited_processes_are_swept() {
        let tmp = std::env::temp_dir().join(format!("kvgate-sweep-test-{}", std::process::id()));
        let mut exited = Command::new("true").spawn().unwrap();
        let dead = exited.id();
        exited.wait().unwrap();
        let [gone, kept, other] = [format!("{DIR_PREFIX}{dead}-1"), format!("{DIR_PREFIX}{}-2", std::process::id()), format!("kvgate-other-{dead}")];
        for d in [&gone, &kept, &other] {
            std::fs::create_dir_all(tmp.join(d).join("etcd")).unwrap();
        }
        sweep_dirs(&tmp);
        assert!(!tmp.join(&gone).exists() && tmp.join(&kept).exists() && tmp.join(&other).exists());
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
