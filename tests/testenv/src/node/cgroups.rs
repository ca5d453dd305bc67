//! Pod resource limits through cgroups, as the kubelet enforces them: one cgroup per pod under a
//! parent the agent creates (inside the agent's own cgroup), `resources.limits.memory` and
//! `resources.limits.cpu` written to it, every container moved in before exec. cgroup v2
//! (`memory.max`, `cpu.max`) and v1 (`memory.limit_in_bytes`, `cpu.cfs_quota_us`) are both
//! supported; these machines mount v1 `memory` and `cpu` beside an empty v2 tree, so v1 is the
//! one the tests exercise. Parents are named `kvgate-agent-<pid>`: the next agent removes those of
//! agents that no longer run.

use std::ffi::CString;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::Context;

const ROOT: &str = "/sys/fs/cgroup";
const CFS_PERIOD_US: u64 = 100_000;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Version {
    V1,
    V2,
}

/// The agent's parent cgroups (one per v1 controller, or one v2 directory).
#[derive(Debug)]
pub struct Cgroups {
    version: Version,
    memory: PathBuf,
    cpu: PathBuf,
}

/// What a pod may use: bytes of memory, thousandths of a CPU.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Limits {
    pub memory: Option<u64>,
    pub millicpu: Option<u64>,
}

/// One pod's cgroup.
#[derive(Debug)]
pub struct PodCgroup {
    version: Version,
    dirs: Vec<PathBuf>,
    /// `cgroup.procs` of each directory, ready for the forked child (no allocation there).
    procs: Vec<CString>,
    memory: PathBuf,
}

impl Cgroups {
    /// Creates this agent's parent cgroups, after removing those of agents that exited. Fails
    /// with the reason when the machine has no writable memory controller.
    pub fn new() -> anyhow::Result<Cgroups> {
        let own = fs::read_to_string("/proc/self/cgroup").context("reading /proc/self/cgroup")?;
        let name = format!("kvgate-agent-{}", std::process::id());
        let (version, memory, cpu) = if Path::new(ROOT).join("cgroup.controllers").is_file() {
            let dir = Path::new(ROOT).join(own_path(&own, "").context("no cgroup v2 entry in /proc/self/cgroup")?);
            (Version::V2, dir.clone(), dir)
        } else {
            let memory = Path::new(ROOT).join("memory").join(own_path(&own, "memory").context("no v1 memory controller in /proc/self/cgroup")?);
            let cpu_mount = ["cpu", "cpu,cpuacct"].iter().map(|m| Path::new(ROOT).join(m)).find(|p| p.join("cpu.cfs_quota_us").is_file());
            let cpu = cpu_mount.context("no v1 cpu controller mounted")?.join(own_path(&own, "cpu").unwrap_or_default());
            (Version::V1, memory, cpu)
        };
        for parent in dedup([&memory, &cpu]) {
            sweep(parent, "kvgate-agent-");
        }
        sweep_containers();
        let me = Cgroups { version, memory: memory.join(&name), cpu: cpu.join(&name) };
        for dir in dedup([&me.memory, &me.cpu]) {
            fs::create_dir_all(dir).with_context(|| format!("creating cgroup {} (the node agent enforces pod limits and needs it writable)", dir.display()))?;
        }
        if version == Version::V2 {
            // Controllers must be enabled for the children of every level we add.
            for dir in [memory.as_path(), me.memory.as_path()] {
                fs::write(dir.join("cgroup.subtree_control"), "+memory +cpu").with_context(|| format!("enabling memory and cpu in {}", dir.display()))?;
            }
        }
        Ok(me)
    }

    /// A cgroup for pod `uid` with `limits` written to it.
    pub fn pod(&self, uid: &str, limits: Limits) -> anyhow::Result<PodCgroup> {
        let name = format!("pod-{uid}");
        let (memory, cpu) = (self.memory.join(&name), self.cpu.join(&name));
        let dirs: Vec<PathBuf> = dedup([&memory, &cpu]).into_iter().cloned().collect();
        for dir in &dirs {
            fs::create_dir_all(dir).with_context(|| format!("creating cgroup {}", dir.display()))?;
        }
        let write = |dir: &Path, file: &str, value: String| {
            fs::write(dir.join(file), &value).with_context(|| format!("writing {value} to {}", dir.join(file).display()))
        };
        match self.version {
            Version::V1 => {
                if let Some(bytes) = limits.memory {
                    write(&memory, "memory.limit_in_bytes", bytes.to_string())?;
                }
                if let Some(m) = limits.millicpu {
                    let (quota, period) = cfs_quota(m);
                    write(&cpu, "cpu.cfs_period_us", period.to_string())?;
                    write(&cpu, "cpu.cfs_quota_us", quota.to_string())?;
                }
            }
            Version::V2 => {
                if let Some(bytes) = limits.memory {
                    write(&memory, "memory.max", bytes.to_string())?;
                }
                if let Some(m) = limits.millicpu {
                    let (quota, period) = cfs_quota(m);
                    write(&cpu, "cpu.max", format!("{quota} {period}"))?;
                }
            }
        }
        let procs = dirs.iter().map(|d| CString::new(d.join("cgroup.procs").into_os_string().into_encoded_bytes()).expect("no NUL in a path")).collect();
        Ok(PodCgroup { version: self.version, dirs, procs, memory })
    }
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        for dir in dedup([&self.memory, &self.cpu]) {
            remove_tree(dir);
        }
    }
}

impl PodCgroup {
    /// The `cgroup.procs` files a container's process writes itself into (see `enter`).
    pub fn procs(&self) -> Vec<CString> {
        self.procs.clone()
    }

    /// A count that grows when the pod's memory limit is hit: v2's `oom_kill` (hierarchical,
    /// so it counts kills in the containers' cgroups below); in v1, where `oom_kill` counts only
    /// the victim's own cgroup (a container's, which runc removes when it exits), the kills here
    /// plus `memory.failcnt`, the times usage hit this cgroup's limit.
    pub fn oom_events(&self) -> u64 {
        let read = |file: &str| fs::read_to_string(self.memory.join(file)).unwrap_or_default();
        let oom_kill = |text: String| text.lines().find_map(|l| l.strip_prefix("oom_kill ")).and_then(|n| n.trim().parse().ok()).unwrap_or(0u64);
        match self.version {
            Version::V1 => oom_kill(read("memory.oom_control")) + read("memory.failcnt").trim().parse().unwrap_or(0u64),
            Version::V2 => oom_kill(read("memory.events")),
        }
    }

    /// Kills what is left in the cgroup and removes it.
    pub fn remove(&self) {
        for dir in &self.dirs {
            remove_tree(dir);
        }
    }
}

/// Moves the calling process into the cgroups whose `cgroup.procs` files are given; for
/// `pre_exec` (no allocation).
pub fn enter(procs: &[CString]) -> std::io::Result<()> {
    for file in procs {
        // SAFETY: open/write/close on a NUL-terminated path made before the fork; "0" is "the
        // writing process" in both cgroup versions.
        unsafe {
            let fd = libc::open(file.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 || libc::write(fd, c"0".as_ptr().cast(), 1) != 1 {
                let err = std::io::Error::last_os_error();
                if fd >= 0 {
                    libc::close(fd);
                }
                return Err(err);
            }
            libc::close(fd);
        }
    }
    Ok(())
}

/// `resources.limits` of every container of a pod, summed as the kubelet sizes the pod cgroup.
pub fn pod_limits(pod: &k8s_openapi::api::core::v1::Pod) -> Result<Limits, String> {
    let mut limits = Limits::default();
    for c in pod.spec.iter().flat_map(|s| s.containers.iter()) {
        let l = container_limits(c)?;
        if let Some(bytes) = l.memory {
            *limits.memory.get_or_insert(0) += bytes;
        }
        if let Some(m) = l.millicpu {
            *limits.millicpu.get_or_insert(0) += m;
        }
    }
    Ok(limits)
}

/// One container's `resources.limits` (its own cgroup's, below the pod's).
pub fn container_limits(c: &k8s_openapi::api::core::v1::Container) -> Result<Limits, String> {
    let mut limits = Limits::default();
    let Some(l) = c.resources.as_ref().and_then(|r| r.limits.as_ref()) else { return Ok(limits) };
    if let Some(q) = l.get("memory") {
        limits.memory = Some(quantity(&q.0).ok_or_else(|| format!("container {}: resources.limits.memory {:?} is not a quantity", c.name, q.0))? as u64);
    }
    if let Some(q) = l.get("cpu") {
        let cpus = quantity(&q.0).ok_or_else(|| format!("container {}: resources.limits.cpu {:?} is not a quantity", c.name, q.0))?;
        limits.millicpu = Some((cpus * 1000.0).ceil() as u64);
    }
    Ok(limits)
}

/// CFS quota for `millicpu` thousandths of a CPU per `CFS_PERIOD_US`.
pub fn cfs_quota(millicpu: u64) -> (u64, u64) {
    ((millicpu * CFS_PERIOD_US / 1000).max(1000), CFS_PERIOD_US)
}

/// A Kubernetes quantity (`512Mi`, `2G`, `500m`, `1.5`) as a number.
pub fn quantity(q: &str) -> Option<f64> {
    const SUFFIXES: [(&str, f64); 13] = [
        ("Ki", 1024.0),
        ("Mi", 1048576.0),
        ("Gi", 1073741824.0),
        ("Ti", 1099511627776.0),
        ("Pi", 1125899906842624.0),
        ("Ei", 1152921504606846976.0),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("E", 1e18),
    ];
    let q = q.trim();
    let (number, scale) = SUFFIXES.iter().find_map(|(s, f)| q.strip_suffix(s).map(|n| (n, *f))).unwrap_or((q, 1.0));
    let n: f64 = number.parse().ok()?;
    (n.is_finite() && n >= 0.0).then_some(n * scale)
}

/// The path of this process's cgroup for `controller` ("" is the v2 entry).
fn own_path(proc_self_cgroup: &str, controller: &str) -> Option<String> {
    proc_self_cgroup.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let hit = if controller.is_empty() { controllers.is_empty() } else { controllers.split(',').any(|c| c == controller) };
        hit.then(|| path.trim_start_matches('/').to_string())
    })
}

fn dedup(dirs: [&PathBuf; 2]) -> Vec<&PathBuf> {
    if dirs[0] == dirs[1] { vec![dirs[0]] } else { dirs.to_vec() }
}

/// Removes the children of `parent` that an agent which exited left: named `PREFIX<pid>` or
/// `PREFIX<pid>-...`, with `prefix` either `kvgate-agent-` (its parent cgroups) or `kvgate-ctr-`
/// (its containers', see `container_name`).
fn sweep(parent: &Path, prefix: &str) {
    let Ok(entries) = fs::read_dir(parent) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(prefix)).and_then(|rest| rest.split('-').next()).and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        if !crate::process::alive(pid) {
            tracing::info!(cgroup = %entry.path().display(), "removing a cgroup of a node agent that exited");
            remove_tree(&entry.path());
        }
    }
}

/// The name of a container's cgroup (and its runc container ID). runc creates it below its own
/// cgroup in every hierarchy: below the pod's for memory and cpu, at the top of the others (v1
/// `pids`, `blkio`, ...), where the agent's pid in the name lets a later agent remove what an
/// agent that was killed left (`sweep_containers`).
pub fn container_name(pod_uid: &str, container: &str) -> String {
    format!("kvgate-ctr-{}-{pod_uid}-{container}", std::process::id())
}

/// Removes the container cgroups (see `container_name`) of agents that no longer run, in every
/// hierarchy mounted under /sys/fs/cgroup.
fn sweep_containers() {
    for hierarchy in fs::read_dir(ROOT).into_iter().flatten().flatten().map(|e| e.path()).chain([PathBuf::from(ROOT)]) {
        sweep(&hierarchy, "kvgate-ctr-");
    }
}

/// Kills every process in `dir` and below, then removes the directories, deepest first.
fn remove_tree(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_tree(&entry.path());
        }
    }
    for _ in 0..50 {
        let pids = fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
        if pids.trim().is_empty() {
            break;
        }
        for pid in pids.lines().filter_map(|p| p.trim().parse::<i32>().ok()) {
            // SAFETY: the process is in a cgroup this agent (or a dead one) created for pods.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    if let Err(e) = fs::remove_dir(dir) {
        tracing::warn!(cgroup = %dir.display(), error = %e, "could not remove a cgroup");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        assert_eq!(quantity("512Mi"), Some(536870912.0));
        assert_eq!(quantity("2G"), Some(2e9));
        assert_eq!(quantity("500m"), Some(0.5));
        assert_eq!(quantity("1.5"), Some(1.5));
        assert_eq!(quantity("lots"), None);
        assert_eq!(quantity("-1Gi"), None);
    }

    #[test]
    fn finds_own_cgroup_per_controller() {
        let text = "9:name=systemd:/\n4:memory:/process_api/abc\n2:cpu,cpuacct:/x\n0::/v2/path\n";
        assert_eq!(own_path(text, "memory").as_deref(), Some("process_api/abc"));
        assert_eq!(own_path(text, "cpu").as_deref(), Some("x"));
        assert_eq!(own_path(text, "").as_deref(), Some("v2/path"));
        assert_eq!(own_path(text, "pids"), None);
    }
}
