//! One pod on the node agent: its containers as local processes in the pod's network namespace
//! and cgroup, their probes and restarts, and the status the kubelet would report.

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
use super::images::ImageTable;
use super::network::{self, Sandbox};
use super::{env, logs, probes, volumes};

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
    /// The pod cgroup's OOM kill count when this run started: a SIGKILL with more is OOMKilled.
    oom_kills_at_start: u64,
    backoff_until: Option<Instant>,
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
    started: Time,
    pub last_status: Option<Value>,
}

fn now() -> Time {
    Time(Timestamp::now())
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
                oom_kills_at_start: 0,
                backoff_until: None,
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

    fn start(&mut self, i: usize, pod: &Pod, images: &ImageTable) {
        let ip = self.ip.to_string();
        let c = &mut self.containers[i];
        let cgroup = match &self.cgroup {
            Ok(cg) => cg.as_ref(),
            Err(message) => {
                c.state = State::Waiting { reason: "CreateContainerError".into(), message: message.clone() };
                return;
            }
        };
        let netns = match std::fs::File::open(&self.sandbox.netns) {
            Ok(f) => f,
            Err(e) => {
                c.state = State::Waiting { reason: "CreateContainerError".into(), message: format!("pod sandbox {}: {e}", self.sandbox.netns.display()) };
                return;
            }
        };
        let program = match images.resolve(c.spec.image.as_deref().unwrap_or("")) {
            Ok(p) => p,
            Err(message) => {
                c.state = State::Waiting { reason: "ErrImagePull".into(), message };
                return;
            }
        };
        let binds = match self.volumes.as_ref().map_err(Clone::clone).and_then(|v| volumes::binds(&c.spec, v)) {
            Ok(b) => b,
            Err(message) => {
                c.state = State::Waiting { reason: "CreateContainerConfigError".into(), message };
                return;
            }
        };
        let vars = match env::build(pod, &c.spec, &ip) {
            Ok(v) => v,
            Err(message) => {
                c.state = State::Waiting { reason: "CreateContainerConfigError".into(), message };
                return;
            }
        };
        // `command` replaces the image's entrypoint: its first word names the binary, which the
        // image table already resolved, so only the rest are arguments.
        let mut argv: Vec<String> = c.spec.command.iter().flatten().skip(1).cloned().collect();
        argv.extend(c.spec.args.iter().flatten().cloned());
        let argv: Vec<String> = argv.iter().map(|a| env::expand(a, &vars)).collect();
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
        let mut cmd = Command::new(&program);
        cmd.args(&argv)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", &self.dir)
            .envs(&vars)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log file"))
            .stderr(file);
        // Containers stay in the agent's process group, so whoever stops the agent's group
        // (the test harness does at exit) stops every pod with it: no orphans.
        if let Some(k) = &self.kubeconfig {
            cmd.env("KUBECONFIG", k);
        }
        // Marks the process as part of this test world (see `netns::sweep`).
        if let Some(world) = std::env::var_os(crate::netns::WORLD) {
            cmd.env(crate::netns::WORLD, world);
        }
        let procs: Vec<CString> = cgroup.map(PodCgroup::procs).unwrap_or_default();
        let netns_fd = netns.as_raw_fd();
        // SAFETY: only syscalls in the forked child (setns; open/write of cgroup.procs; unshare
        // and mount for volumes), on values prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(netns_fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                cgroups::enter(&procs)?;
                volumes::enter(&binds)
            });
        }
        let oom_kills = cgroup.map_or(0, PodCgroup::oom_kills);
        let spawned = cmd.spawn();
        drop(netns);
        match spawned {
            Ok(child) => {
                c.child = Some(child);
                c.state = State::Running { started: now() };
                c.started_at = Some(Instant::now());
                c.oom_kills_at_start = oom_kills;
                c.ready = false;
                c.readiness = Probing::default();
                c.liveness = Probing::default();
            }
            Err(e) => c.state = State::Waiting { reason: "RunContainerError".into(), message: format!("{}: {e}", program.display()) },
        }
    }

    /// Starts what should run, notices exits, restarts per policy, and runs due probes.
    pub async fn tick(&mut self, pod: &Pod, images: &ImageTable) {
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
                let oom_killed = status.signal() == Some(libc::SIGKILL)
                    && self.cgroup.as_ref().ok().and_then(Option::as_ref).is_some_and(|cg| cg.oom_kills() > c.oom_kills_at_start);
                let reason = match exit_code {
                    0 => "Completed",
                    _ if oom_killed => "OOMKilled",
                    _ => "Error",
                };
                c.state = State::Terminated { exit_code, reason: reason.into(), started, finished: now() };
                c.child = None;
                c.ready = false;
                let restart = policy == "Always" || (policy == "OnFailure" && exit_code != 0);
                if restart {
                    // Back off 1 s, 2 s, 4 s ... up to 30 s, as CrashLoopBackOff does (faster).
                    let delay = Duration::from_secs(1u64 << c.restarts.min(5) as u64).min(Duration::from_secs(30));
                    c.backoff_until = Some(Instant::now() + delay);
                }
            }
            let c = &mut self.containers[i];
            let due = match (&c.state, c.backoff_until) {
                (State::Waiting { reason, .. }, _) if reason == "ContainerCreating" || reason == "CreateContainerConfigError" => true,
                (State::Waiting { reason, .. }, _) if reason == "ErrImagePull" || reason == "ImagePullBackOff" => false,
                (State::Terminated { .. }, Some(t)) => Instant::now() >= t,
                _ => false,
            };
            if due {
                if c.backoff_until.take().is_some() {
                    c.restarts += 1;
                }
                self.start(i, pod, images);
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
                    if let Some(child) = c.child.as_mut() {
                        // SAFETY: signalling the container's own process.
                        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
                    }
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
                    "name": c.spec.name, "image": c.spec.image, "imageID": "", "ready": c.ready,
                    "restartCount": c.restarts, "started": matches!(c.state, State::Running { .. }), "state": state,
                })
            })
            .collect();
        json!({
            "phase": phase,
            "podIP": self.ip.to_string(),
            "podIPs": [{ "ip": self.ip.to_string() }],
            "hostIP": network::GATEWAY.to_string(),
            "hostIPs": [{ "ip": network::GATEWAY.to_string() }],
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
            if let Some(child) = &c.child {
                // SAFETY: signalling the container's own process.
                unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            }
        }
        for c in &mut self.containers {
            if let Some(mut child) = c.child.take() {
                while Instant::now() < deadline {
                    if let Ok(Some(_)) = child.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                // SAFETY: as above; the child is not reaped yet, so the pid is still ours.
                unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
                let _ = child.wait();
            }
        }
    }

    /// Stops the containers, releases the pod's address and namespace, removes its cgroup.
    pub fn tear_down(mut self, grace: Duration, network: &network::PodNetwork) {
        self.stop(grace);
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
