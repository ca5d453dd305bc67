//! One pod on the node agent: its containers as OCI containers run by runc (or, for test tools
//! without an image, host processes) in the pod's network namespace and cgroup, their probes and
//! restarts, and the status the kubelet would report.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

use super::cgroups::{self, PodCgroup};
use super::images::{Image, ImageTable};
use super::network::{self, Sandbox};
use super::oci_image::ImageStore;
use super::pull::Puller;
use super::runc::Runc;
use super::{bundle, dns, env, logs, probes, rootfs, volumes};

#[derive(Debug, Clone)]
enum State {
    Waiting { reason: String, message: String },
    Running { started: Time },
    Terminated { exit_code: i32, reason: String, started: Time, finished: Time },
}

#[derive(Debug, Default)]
struct Probing {
    next_at: Option<Instant>,
    failures: i32,
}

#[derive(Debug)]
struct ContainerRt {
    spec: Container,
    child: Option<Child>,
    restarts: i32,
    state: State,
    ready: bool,
    started_at: Option<Instant>,
    /// The pod cgroup's OOM events when this run started: a SIGKILL with more is OOMKilled.
    oom_events_at_start: u64,
    /// Set while the container runs under runc: how to signal it.
    runc_id: Option<(Runc, String)>,
    /// The image's digest (`imageID` in the status), for OCI images.
    image_id: String,
    backoff_until: Option<Instant>,
    /// Failed pulls in a row, and when the next try is due (`ImagePullBackOff` until then).
    pull_failures: u32,
    pull_retry_at: Option<Instant>,
    readiness: Probing,
    liveness: Probing,
}

#[derive(Debug)]
pub struct PodRt {
    pub uid: String,
    pub ip: Ipv4Addr,
    sandbox: Sandbox,
    /// The pod's cgroup, or why its limits cannot be enforced here (then nothing starts).
    cgroup: Result<Option<PodCgroup>, String>,
    dir: PathBuf,
    containers: Vec<ContainerRt>,
    kubeconfig: Option<PathBuf>,
    /// The service-account token (for the projected token volume).
    pub token: Option<String>,
    /// Volume name -> directory, or why the pod's volumes could not be prepared.
    volumes: Result<BTreeMap<String, PathBuf>, String>,
    /// The Secret keys its env names, or why one could not be read (retried, as volumes are).
    secret_env: Result<env::SecretValues, String>,
    started: Time,
    pub last_status: Option<Value>,
}

/// Where the kubeconfig the agent writes for a pod appears inside its containers.
const POD_KUBECONFIG: &str = "/var/run/secrets/kvgate.dev/kubeconfig";

/// How containers are run: the pre-loaded images, pulls, unpacked images, and runc (or why it
/// is missing).
#[derive(Debug)]
pub struct Runtime {
    pub images: ImageTable,
    pub puller: Puller,
    pub store: ImageStore,
    pub runc: Result<Runc, String>,
}

/// A container ready to spawn: the command, runc's handle on it, and its `imageID`.
type Launch = (Command, Option<(Runc, String)>, String);

fn now() -> Time {
    Time(Timestamp::now())
}

/// The wait after `failures` failed pulls in a row: 1 s, 2 s, 4 s ... up to 30 s (the kubelet's
/// starts at 10 s and stops at 300 s; a test world has less time to wait).
fn pull_backoff(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.saturating_sub(1).min(5)).min(Duration::from_secs(30))
}

impl PodRt {
    pub fn new(
        pod: &Pod,
        sandbox: Sandbox,
        cgroup: Result<Option<PodCgroup>, String>,
        dir: PathBuf,
        kubeconfig: Option<PathBuf>,
        token: Option<String>,
        volumes: Result<BTreeMap<String, PathBuf>, String>,
    ) -> Self {
        let containers = pod
            .spec
            .iter()
            .flat_map(|s| s.containers.iter())
            .map(|c| ContainerRt {
                spec: c.clone(),
                child: None,
                restarts: 0,
                state: State::Waiting { reason: "ContainerCreating".into(), message: String::new() },
                ready: false,
                started_at: None,
                oom_events_at_start: 0,
                runc_id: None,
                image_id: String::new(),
                backoff_until: None,
                pull_failures: 0,
                pull_retry_at: None,
                readiness: Probing::default(),
                liveness: Probing::default(),
            })
            .collect();
        let _ = std::fs::write(dir.join("network.json"), json!({ "ip": sandbox.ip, "hostLink": sandbox.host_link, "netns": sandbox.netns }).to_string());
        PodRt {
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            ip: sandbox.ip,
            sandbox,
            cgroup,
            dir,
            containers,
            kubeconfig,
            token,
            volumes,
            secret_env: Err("not read yet".into()),
            started: now(),
            last_status: None,
        }
    }

    /// Volumes not ready yet (e.g. a Secret not created yet) are retried, as the kubelet does.
    pub fn volumes_missing(&self) -> bool {
        self.volumes.is_err()
    }

    pub fn set_volumes(&mut self, volumes: Result<BTreeMap<String, PathBuf>, String>) {
        self.volumes = volumes;
    }

    /// The env's Secret keys are not read yet (or a Secret was missing): read them again.
    pub fn secret_env_missing(&self) -> bool {
        self.secret_env.is_err()
    }

    pub fn set_secret_env(&mut self, values: Result<env::SecretValues, String>) {
        self.secret_env = values;
    }

    /// A service-account token obtained after the pod was admitted, and its kubeconfig.
    pub fn set_token(&mut self, token: String, kubeconfig: Option<PathBuf>) {
        self.token = Some(token);
        self.kubeconfig = kubeconfig;
    }

    fn start(&mut self, i: usize, pod: &Pod, rt: &Runtime) {
        let launch = self.launch(i, pod, rt);
        let cgroup = self.cgroup.as_ref().ok().and_then(Option::as_ref);
        let c = &mut self.containers[i];
        let (mut cmd, runc_id, image_id) = match launch {
            Ok(l) => {
                (c.pull_failures, c.pull_retry_at) = (0, None);
                l
            }
            Err((reason, message)) => {
                if reason == "ErrImagePull" {
                    c.pull_failures += 1;
                    c.pull_retry_at = Some(Instant::now() + pull_backoff(c.pull_failures));
                }
                c.state = State::Waiting { reason: reason.into(), message };
                return;
            }
        };
        // A restart keeps the last run's output for `kubectl logs --previous`, as the kubelet does.
        if matches!(c.state, State::Terminated { .. })
            && let Err(e) = logs::rotate(&self.dir, &c.spec.name)
        {
            tracing::warn!(container = c.spec.name, error = %e, "cannot keep the previous run's log");
        }
        let log = logs::current(&self.dir, &c.spec.name);
        let file = match std::fs::OpenOptions::new().create(true).append(true).open(&log) {
            Ok(f) => f,
            Err(e) => {
                c.state = State::Waiting { reason: "CreateContainerError".into(), message: e.to_string() };
                return;
            }
        };
        // Containers stay in the agent's process group, so whoever stops the agent's group
        // (the test harness does at exit) stops every pod with it: no orphans.
        cmd.stdin(Stdio::null()).stdout(file.try_clone().expect("log file")).stderr(file);
        let procs: Vec<CString> = cgroup.map(PodCgroup::procs).unwrap_or_default();
        // SAFETY: only open/write of cgroup.procs in the forked child, on paths made before.
        unsafe {
            cmd.pre_exec(move || cgroups::enter(&procs));
        }
        let oom_events = cgroup.map_or(0, PodCgroup::oom_events);
        match cmd.spawn() {
            Ok(child) => {
                c.child = Some(child);
                c.runc_id = runc_id;
                c.image_id = image_id;
                c.state = State::Running { started: now() };
                c.started_at = Some(Instant::now());
                c.oom_events_at_start = oom_events;
                c.ready = false;
                c.readiness = Probing::default();
                c.liveness = Probing::default();
            }
            Err(e) => c.state = State::Waiting { reason: "RunContainerError".into(), message: format!("{:?}: {e}", cmd.get_program()) },
        }
    }

    /// Everything container `i` needs before it can be spawned, or the waiting reason and
    /// message the kubelet would report.
    fn launch(&self, i: usize, pod: &Pod, rt: &Runtime) -> Result<Launch, (&'static str, String)> {
        let c = &self.containers[i];
        if let Err(message) = &self.cgroup {
            return Err(("CreateContainerError", message.clone()));
        }
        std::fs::metadata(&self.sandbox.netns).map_err(|e| ("CreateContainerError", format!("pod sandbox {}: {e}", self.sandbox.netns.display())))?;
        let reference = c.spec.image.as_deref().unwrap_or("");
        let (image, pulled_from) = match rt.images.resolve(reference) {
            Image::Pull(reference) => {
                let policy = c.spec.image_pull_policy.as_deref().unwrap_or("IfNotPresent");
                let pulled = rt.puller.image(&reference, policy)?;
                (Image::Oci { layout: pulled.layout, tag: pulled.tag }, Some(super::images::repository(&reference).to_string()))
            }
            image => (image, None),
        };
        let config_error = |e: String| ("CreateContainerConfigError", e);
        let secrets = self.secret_env.as_ref().map_err(|e| config_error(e.clone()))?;
        let mut vars = env::build(pod, &c.spec, &self.ip.to_string(), &self.sandbox.host_ip.to_string(), secrets).map_err(config_error)?;
        // Marks the container's processes as part of this test world (see `netns::sweep`).
        if let Some(world) = std::env::var_os(crate::netns::WORLD) {
            vars.insert(crate::netns::WORLD.into(), world.to_string_lossy().into_owned());
        }
        match image {
            Image::Oci { layout, tag } => {
                let (cmd, runc_id, image_id) = self.oci_container(i, pod, rt, &layout, &tag, vars)?;
                // A pulled image is known by its repository and digest, as the kubelet reports it.
                let image_id = match pulled_from {
                    Some(repository) => format!("{repository}@{}", image_id.rsplit('@').next().unwrap_or_default()),
                    None => image_id,
                };
                Ok((cmd, runc_id, image_id))
            }
            Image::Host(program) => self.host_process(i, &program, vars),
            Image::Pull(_) => unreachable!("pulled above"),
        }
    }

    /// `runc run` of an OCI bundle written for container `i`: the image's root filesystem
    /// (shared and read-only, or the container's own overlay of it when the root is writable),
    /// its process resolved from the pod spec, the pod's volumes, `/etc/hosts`,
    /// `/etc/resolv.conf` and kubeconfig bound in, the pod's network namespace, and a cgroup
    /// below the pod's (runc starts inside the pod's cgroup).
    fn oci_container(
        &self,
        i: usize,
        pod: &Pod,
        rt: &Runtime,
        layout: &Path,
        tag: &str,
        mut vars: BTreeMap<String, String>,
    ) -> Result<Launch, (&'static str, String)> {
        let c = &self.containers[i];
        let runc = rt.runc.as_ref().map_err(|e| ("CreateContainerError", e.clone()))?;
        let image = rt.store.unpack(layout, tag).map_err(|e| ("ErrImagePull", e))?;
        let config_error = |e: String| ("CreateContainerConfigError", e);
        let mut mounts = self.volumes.as_ref().map_err(Clone::clone).and_then(|v| volumes::mounts(&c.spec, v)).map_err(config_error)?;
        let hosts = self.dir.join("hosts");
        let name = pod.metadata.name.clone().unwrap_or_default();
        std::fs::write(&hosts, format!("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n{}\t{name}\n", self.ip))
            .map_err(|e| ("CreateContainerError", e.to_string()))?;
        mounts.push(bundle::Mount { source: hosts, destination: "/etc/hosts".into(), read_only: true });
        let resolv = self.dir.join("resolv.conf");
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
        std::fs::write(&resolv, dns::resolv_conf(namespace, self.sandbox.gateway)).map_err(|e| ("CreateContainerError", e.to_string()))?;
        mounts.push(bundle::Mount { source: resolv, destination: "/etc/resolv.conf".into(), read_only: true });
        if let Some(k) = &self.kubeconfig {
            mounts.push(bundle::Mount { source: k.clone(), destination: POD_KUBECONFIG.into(), read_only: true });
            vars.insert("KUBECONFIG".into(), POD_KUBECONFIG.into());
        }
        let process = bundle::process(pod, &c.spec, &image.config, &vars).map_err(config_error)?;
        let dir = self.dir.join("bundles").join(&c.spec.name);
        let io = |e: std::io::Error| ("CreateContainerError", format!("bundle {}: {e}", dir.display()));
        let rootfs = if process.read_only_root {
            image.rootfs.clone()
        } else {
            // A writable root is the container's own: the image again each run (node::rootfs).
            rootfs::writable(&dir, &image.rootfs).map_err(|e| ("CreateContainerError", format!("bundle {}: {e}", dir.display())))?
        };
        let id = cgroups::container_name(&self.uid, &c.spec.name);
        let limits = cgroups::container_limits(&c.spec).map_err(config_error)?;
        let spec = bundle::spec(&process, &name, &rootfs, &mounts, &self.sandbox.netns, &id, limits);
        std::fs::create_dir_all(&dir).map_err(io)?;
        std::fs::write(dir.join("config.json"), spec.to_string()).map_err(io)?;
        runc.delete(&id);
        let mut cmd = runc.run(&dir, &id);
        cmd.env_clear().env("PATH", std::env::var("PATH").unwrap_or_default()).current_dir(&dir);
        if let Some(world) = std::env::var_os(crate::netns::WORLD) {
            cmd.env(crate::netns::WORLD, world);
        }
        Ok((cmd, Some((runc.clone(), id)), format!("oci-layout://{}@{}", layout.display(), image.digest)))
    }

    /// A host binary (a test tool without an image) as a process in the pod's network and mount
    /// namespaces, with the volumes bound in.
    fn host_process(&self, i: usize, program: &Path, vars: BTreeMap<String, String>) -> Result<Launch, (&'static str, String)> {
        let c = &self.containers[i];
        let binds = self.volumes.as_ref().map_err(Clone::clone).and_then(|v| volumes::binds(&c.spec, v)).map_err(|e| ("CreateContainerConfigError", e))?;
        let netns =
            std::fs::File::open(&self.sandbox.netns).map_err(|e| ("CreateContainerError", format!("pod sandbox {}: {e}", self.sandbox.netns.display())))?;
        // `command` replaces the image's entrypoint: its first word names the binary, which the
        // image table already resolved, so only the rest are arguments.
        let mut argv: Vec<String> = c.spec.command.iter().flatten().skip(1).cloned().collect();
        argv.extend(c.spec.args.iter().flatten().cloned());
        let argv: Vec<String> = argv.iter().map(|a| env::expand(a, &vars)).collect();
        let mut cmd = Command::new(program);
        cmd.args(&argv).env_clear().env("PATH", std::env::var("PATH").unwrap_or_default()).env("HOME", &self.dir).envs(&vars).current_dir(&self.dir);
        if let Some(k) = &self.kubeconfig {
            cmd.env("KUBECONFIG", k);
        }
        // SAFETY: only syscalls in the forked child (setns; unshare and mount for volumes), on
        // values prepared before the fork; the fd is moved into the closure and outlives it.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                volumes::enter(&binds)
            });
        }
        Ok((cmd, None, String::new()))
    }

    /// Starts what should run, notices exits, restarts per policy, and runs due probes.
    pub async fn tick(&mut self, pod: &Pod, rt: &Runtime) {
        let policy = pod.spec.as_ref().and_then(|s| s.restart_policy.clone()).unwrap_or_else(|| "Always".into());
        for i in 0..self.containers.len() {
            let c = &mut self.containers[i];
            if let Some(child) = c.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                // A signal is reported as 128 + its number, as container runtimes do.
                let exit_code = status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(libc::SIGKILL));
                let started = match &c.state {
                    State::Running { started } => started.clone(),
                    _ => now(),
                };
                let oom_killed = exit_code == 128 + libc::SIGKILL
                    && self.cgroup.as_ref().ok().and_then(Option::as_ref).is_some_and(|cg| cg.oom_events() > c.oom_events_at_start);
                let reason = match exit_code {
                    0 => "Completed",
                    _ if oom_killed => "OOMKilled",
                    _ => "Error",
                };
                c.state = State::Terminated { exit_code, reason: reason.into(), started, finished: now() };
                c.child = None;
                if let Some((runc, id)) = c.runc_id.take() {
                    runc.delete(&id);
                }
                c.ready = false;
                let restart = policy == "Always" || (policy == "OnFailure" && exit_code != 0);
                if restart {
                    // Back off 1 s, 2 s, 4 s ... up to 30 s, as CrashLoopBackOff does (faster).
                    let delay = Duration::from_secs(1u64 << c.restarts.min(5) as u64).min(Duration::from_secs(30));
                    c.backoff_until = Some(Instant::now() + delay);
                }
            }
            let c = &mut self.containers[i];
            // Between failed pulls the container waits in ImagePullBackOff, as the kubelet's does.
            if let State::Waiting { reason, message } = &c.state
                && reason == "ErrImagePull"
                && c.pull_retry_at.is_some_and(|t| Instant::now() < t)
            {
                let message = format!("Back-off pulling image \"{}\": ErrImagePull: {message}", c.spec.image.as_deref().unwrap_or(""));
                c.state = State::Waiting { reason: "ImagePullBackOff".into(), message };
            }
            let due = match (&c.state, c.backoff_until) {
                (State::Waiting { reason, .. }, _) if reason == "ContainerCreating" || reason == "CreateContainerConfigError" => true,
                (State::Waiting { reason, .. }, _) if reason == "ErrImagePull" || reason == "ImagePullBackOff" => {
                    c.pull_retry_at.is_some_and(|t| Instant::now() >= t)
                }
                (State::Terminated { .. }, Some(t)) => Instant::now() >= t,
                _ => false,
            };
            if due {
                if c.backoff_until.take().is_some() {
                    c.restarts += 1;
                }
                self.start(i, pod, rt);
            }
            self.probe(i).await;
        }
    }

    async fn probe(&mut self, i: usize) {
        let ip = self.ip.to_string();
        let c = &mut self.containers[i];
        let Some(started) = c.started_at.filter(|_| c.child.is_some()) else { return };
        if let Some(p) = c.spec.liveness_probe.clone()
            && due(&mut c.liveness, &p, started)
        {
            if let Err(reason) = probes::run(&p, &c.spec, &ip).await {
                c.liveness.failures += 1;
                if c.liveness.failures >= p.failure_threshold.unwrap_or(3) {
                    tracing::info!(container = c.spec.name, reason, "liveness probe failed; restarting");
                    c.signal(libc::SIGKILL);
                }
            } else {
                c.liveness.failures = 0;
            }
        }
        match c.spec.readiness_probe.clone() {
            None => c.ready = true,
            Some(p) => {
                if due(&mut c.readiness, &p, started) {
                    match probes::run(&p, &c.spec, &ip).await {
                        Ok(()) => {
                            c.readiness.failures = 0;
                            c.ready = true;
                        }
                        Err(_) => {
                            c.readiness.failures += 1;
                            if c.readiness.failures >= p.failure_threshold.unwrap_or(3) {
                                c.ready = false;
                            }
                        }
                    }
                }
            }
        }
    }

    /// The status the kubelet would report, with `Ready` honouring the pod's readiness gates.
    pub fn status(&self, pod: &Pod) -> Value {
        let all_running = self.containers.iter().all(|c| matches!(c.state, State::Running { .. }));
        let all_ready = !self.containers.is_empty() && self.containers.iter().all(|c| c.ready);
        let terminal = self.containers.iter().all(|c| matches!(c.state, State::Terminated { .. }) && c.backoff_until.is_none());
        let phase = if all_running {
            "Running"
        } else if terminal {
            if self.containers.iter().all(|c| matches!(c.state, State::Terminated { exit_code: 0, .. })) { "Succeeded" } else { "Failed" }
        } else if self.containers.iter().any(|c| c.restarts > 0 || matches!(c.state, State::Running { .. })) {
            "Running"
        } else {
            "Pending"
        };
        let existing = pod.status.as_ref().and_then(|s| s.conditions.clone()).unwrap_or_default();
        let gates_ok = pod
            .spec
            .iter()
            .flat_map(|s| s.readiness_gates.iter().flatten())
            .all(|g| existing.iter().any(|c| c.type_ == g.condition_type && c.status == "True"));
        let ready = all_ready && gates_ok;
        let cond = |t: &str, ok: bool, reason: Option<&str>| {
            let status = if ok { "True" } else { "False" };
            // Keep the transition time while the status holds.
            let since = existing.iter().find(|c| c.type_ == t && c.status == status).and_then(|c| c.last_transition_time.clone()).unwrap_or_else(now);
            let mut v = json!({ "type": t, "status": status, "lastTransitionTime": since, "lastProbeTime": null });
            if let Some(r) = reason.filter(|_| !ok) {
                v["reason"] = json!(r);
            }
            v
        };
        let statuses: Vec<Value> = self
            .containers
            .iter()
            .map(|c| {
                let state = match &c.state {
                    State::Waiting { reason, message } => json!({ "waiting": { "reason": reason, "message": message } }),
                    State::Running { started } => json!({ "running": { "startedAt": started } }),
                    State::Terminated { exit_code, reason, started, finished } => {
                        if c.backoff_until.is_some() {
                            json!({ "waiting": { "reason": "CrashLoopBackOff", "message": format!("back-off restarting failed container {}", c.spec.name) } })
                        } else {
                            json!({ "terminated": { "exitCode": exit_code, "reason": reason, "startedAt": started, "finishedAt": finished } })
                        }
                    }
                };
                json!({
                    "name": c.spec.name, "image": c.spec.image, "imageID": c.image_id, "ready": c.ready,
                    "restartCount": c.restarts, "started": matches!(c.state, State::Running { .. }), "state": state,
                })
            })
            .collect();
        json!({
            "phase": phase,
            "podIP": self.ip.to_string(),
            "podIPs": [{ "ip": self.ip.to_string() }],
            "hostIP": self.sandbox.host_ip.to_string(),
            "hostIPs": [{ "ip": self.sandbox.host_ip.to_string() }],
            "startTime": self.started,
            "conditions": [
                cond("PodScheduled", true, None),
                cond("Initialized", true, None),
                cond("ContainersReady", all_ready, Some("ContainersNotReady")),
                cond("Ready", ready, Some(if all_ready { "ReadinessGatesNotReady" } else { "ContainersNotReady" })),
            ],
            "containerStatuses": statuses,
        })
    }

    /// SIGTERM, up to `grace` to exit, then SIGKILL.
    pub fn stop(&mut self, grace: Duration) {
        let deadline = Instant::now() + grace;
        for c in &mut self.containers {
            c.signal(libc::SIGTERM);
        }
        for c in &mut self.containers {
            if let Some(mut child) = c.child.take() {
                while Instant::now() < deadline {
                    if let Ok(Some(_)) = child.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                if let Some((runc, id)) = c.runc_id.take() {
                    let _ = runc.kill(&id, "KILL");
                    let _ = child.wait();
                    runc.delete(&id);
                } else {
                    // SAFETY: the child is not reaped yet, so the pid is still ours.
                    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
                    let _ = child.wait();
                }
            }
        }
    }

    /// Stops the containers, releases the pod's address and namespace, removes its cgroup and
    /// its containers' bundles (a writable root's overlay, and what the container wrote there).
    pub fn tear_down(mut self, grace: Duration, network: &network::PodNetwork) {
        self.stop(grace);
        for c in &self.containers {
            rootfs::release(&self.dir.join("bundles").join(&c.spec.name));
        }
        let _ = std::fs::remove_dir_all(self.dir.join("bundles"));
        network.del(self.sandbox);
        if let Ok(Some(cg)) = &self.cgroup {
            cg.remove();
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Container name -> whether it runs now (for the log endpoint's `follow`).
    pub fn running(&self) -> BTreeMap<String, bool> {
        self.containers.iter().map(|c| (c.spec.name.clone(), c.child.is_some())).collect()
    }
}

impl ContainerRt {
    /// Signals the container's process: through runc for an OCI container (SIGKILL cannot be
    /// forwarded by runc), directly for a host process.
    fn signal(&self, signal: i32) {
        let Some(child) = &self.child else { return };
        match &self.runc_id {
            Some((runc, id)) => {
                let name = if signal == libc::SIGKILL { "KILL" } else { "TERM" };
                if let Err(e) = runc.kill(id, name) {
                    tracing::debug!(container = self.spec.name, error = e, "runc kill");
                }
            }
            // SAFETY: signalling the container's own process, not reaped yet.
            None => unsafe {
                libc::kill(child.id() as i32, signal);
            },
        }
    }
}

fn due(p: &mut Probing, probe: &k8s_openapi::api::core::v1::Probe, started: Instant) -> bool {
    let now = Instant::now();
    let first = started + Duration::from_secs(probe.initial_delay_seconds.unwrap_or(0) as u64);
    let next = p.next_at.unwrap_or(first);
    if now < next {
        return false;
    }
    p.next_at = Some(now + Duration::from_secs(probe.period_seconds.unwrap_or(10).max(1) as u64));
    true
}
