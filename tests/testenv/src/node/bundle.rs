//! A container's OCI runtime configuration (`config.json` of its bundle) from the pod spec and
//! the image, resolved the way the kubelet and a CRI runtime resolve them: `command` replaces
//! the entrypoint and `args` the image's `Cmd`; `securityContext` (the container's over the
//! pod's) gives the user, groups, capabilities, `noNewPrivileges` and a read-only root.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Container, Pod};
use serde_json::{Value, json};

use super::cgroups::{Limits, cfs_quota};
use super::env;
use super::oci_image::ImageConfig;

/// What a CRI runtime grants a container that neither adds nor drops capabilities
/// (containerd's default set).
const DEFAULT_CAPABILITIES: [&str; 14] = [
    "CHOWN",
    "DAC_OVERRIDE",
    "FSETID",
    "FOWNER",
    "MKNOD",
    "NET_RAW",
    "SETGID",
    "SETUID",
    "SETFCAP",
    "SETPCAP",
    "NET_BIND_SERVICE",
    "SYS_CHROOT",
    "KILL",
    "AUDIT_WRITE",
];

/// What `seccompProfile: RuntimeDefault` gives a container here: every system call allowed but
/// those a container has no business making (they change the machine, other namespaces or the
/// kernel; the calls Docker's and containerd's default profiles refuse to unprivileged
/// containers), which fail with EPERM. A deny list, where those runtimes ship an allow list.
const RUNTIME_DEFAULT_DENIED: [&str; 33] = [
    "acct",
    "add_key",
    "bpf",
    "clock_adjtime",
    "clock_settime",
    "create_module",
    "delete_module",
    "finit_module",
    "fsconfig",
    "fsmount",
    "fsopen",
    "fspick",
    "init_module",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "mount",
    "move_mount",
    "open_by_handle_at",
    "open_tree",
    "perf_event_open",
    "pivot_root",
    "quotactl",
    "reboot",
    "request_key",
    "setns",
    "settimeofday",
    "swapoff",
    "swapon",
    "umount2",
    "unshare",
    "userfaultfd",
];

/// The container's process, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct Process {
    pub args: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    pub additional_gids: Vec<u32>,
    /// Bounding set, `CAP_` names.
    pub capabilities: Vec<String>,
    pub no_new_privileges: bool,
    pub read_only_root: bool,
    /// `seccompProfile: RuntimeDefault` (the container's, else the pod's).
    pub runtime_default_seccomp: bool,
}

/// A bind mount into the container.
#[derive(Debug, Clone, PartialEq)]
pub struct Mount {
    pub source: PathBuf,
    pub destination: String,
    pub read_only: bool,
}

/// `uid[:gid]` of an image's `User`; names would need the image's /etc/passwd, which the
/// images kvgate builds never need.
fn image_user(user: &str) -> Result<(u32, Option<u32>), String> {
    let (u, g) = user.split_once(':').map_or((user, None), |(u, g)| (u, Some(g)));
    let uid = u.parse().map_err(|_| format!("image user {user:?} is not numeric (uid[:gid]); set securityContext.runAsUser"))?;
    let gid = g.map(|g| g.parse().map_err(|_| format!("image group {g:?} is not numeric"))).transpose()?;
    Ok((uid, gid))
}

/// Resolves the process of container `c` of `pod` from `image`; `vars` is the container's
/// environment as `env::build` made it. Errors read like the kubelet's
/// `CreateContainerConfigError` messages.
pub fn process(pod: &Pod, c: &Container, image: &ImageConfig, vars: &BTreeMap<String, String>) -> Result<Process, String> {
    let pod_sc = pod.spec.as_ref().and_then(|s| s.security_context.as_ref());
    let sc = c.security_context.as_ref();
    if sc.and_then(|s| s.privileged) == Some(true) {
        return Err("privileged containers are not supported by the kvgate node agent".into());
    }
    let (image_uid, image_gid) = image.user.as_deref().map(image_user).transpose()?.unwrap_or((0, None));
    let uid = sc
        .and_then(|s| s.run_as_user)
        .or(pod_sc.and_then(|s| s.run_as_user))
        .map_or(Ok(image_uid), |u| u32::try_from(u).map_err(|_| format!("runAsUser {u} out of range")))?;
    let gid = sc
        .and_then(|s| s.run_as_group)
        .or(pod_sc.and_then(|s| s.run_as_group))
        .map_or(Ok(image_gid.unwrap_or(0)), |g| u32::try_from(g).map_err(|_| format!("runAsGroup {g} out of range")))?;
    let non_root = sc.and_then(|s| s.run_as_non_root).or(pod_sc.and_then(|s| s.run_as_non_root)) == Some(true);
    if non_root && uid == 0 {
        return Err("container has runAsNonRoot and image will run as root".into());
    }
    let mut additional_gids: Vec<u32> =
        pod_sc.iter().flat_map(|s| s.supplemental_groups.iter().flatten().copied().chain(s.fs_group)).filter_map(|g| u32::try_from(g).ok()).collect();
    additional_gids.sort_unstable();
    additional_gids.dedup();

    let caps = sc.and_then(|s| s.capabilities.as_ref());
    let drop: Vec<&str> = caps.iter().flat_map(|c| c.drop.iter().flatten()).map(String::as_str).collect();
    let mut capabilities: Vec<String> =
        if drop.contains(&"ALL") { Vec::new() } else { DEFAULT_CAPABILITIES.iter().filter(|c| !drop.contains(c)).map(|c| c.to_string()).collect() };
    capabilities.extend(caps.iter().flat_map(|c| c.add.iter().flatten()).cloned());
    let mut capabilities: Vec<String> = capabilities.into_iter().map(|c| if c.starts_with("CAP_") { c } else { format!("CAP_{c}") }).collect();
    capabilities.sort();
    capabilities.dedup();

    let seccomp = sc.and_then(|s| s.seccomp_profile.as_ref()).or(pod_sc.and_then(|s| s.seccomp_profile.as_ref()));
    let runtime_default_seccomp = match seccomp.map(|p| p.type_.as_str()) {
        None | Some("Unconfined") => false,
        Some("RuntimeDefault") => true,
        Some(other) => return Err(format!("seccompProfile type {other} is not supported by the kvgate node agent (RuntimeDefault or Unconfined)")),
    };

    let expand = |v: &Vec<String>| v.iter().map(|a| env::expand(a, vars)).collect::<Vec<_>>();
    let mut args = match &c.command {
        Some(command) => expand(command),
        None => image.entrypoint.clone(),
    };
    match (&c.args, &c.command) {
        (Some(a), _) => args.extend(expand(a)),
        (None, None) => args.extend(image.cmd.iter().cloned()),
        (None, Some(_)) => {}
    }
    if args.is_empty() {
        return Err("no command: the image has no entrypoint and the container sets no command".into());
    }

    let mut environment: BTreeMap<String, String> = image.env.iter().filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect();
    environment.extend(vars.iter().map(|(k, v)| (k.clone(), v.clone())));
    environment.entry("HOSTNAME".into()).or_insert_with(|| pod.metadata.name.clone().unwrap_or_default());
    Ok(Process {
        args,
        env: environment.into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
        cwd: c.working_dir.clone().or_else(|| image.working_dir.clone()).unwrap_or_else(|| "/".into()),
        uid,
        gid,
        additional_gids,
        capabilities,
        no_new_privileges: sc.and_then(|s| s.allow_privilege_escalation) == Some(false),
        read_only_root: sc.and_then(|s| s.read_only_root_filesystem) == Some(true),
        runtime_default_seccomp,
    })
}

/// The bundle's `config.json`: the process, the root filesystem, the standard `/proc`, `/dev`,
/// `/sys` and `/sys/fs/cgroup` mounts plus `mounts`, its own pid, ipc, uts, mount and cgroup
/// namespaces, the pod's network namespace, and a cgroup at `cgroups_path` (relative: below
/// runc's own, the pod's) with the container's own `limits`, as a CRI runtime sets them.
pub fn spec(p: &Process, hostname: &str, rootfs: &Path, mounts: &[Mount], netns: &Path, cgroups_path: &str, limits: Limits) -> Value {
    let mut all_mounts = vec![
        json!({ "destination": "/proc", "type": "proc", "source": "proc" }),
        json!({ "destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"] }),
        json!({ "destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"] }),
        json!({ "destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"] }),
        json!({ "destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"] }),
        json!({ "destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"] }),
        json!({ "destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": ["nosuid", "noexec", "nodev", "relatime", "ro"] }),
    ];
    let mut resources = json!({ "devices": [{ "allow": false, "access": "rwm" }] });
    if let Some(bytes) = limits.memory {
        resources["memory"] = json!({ "limit": bytes });
    }
    if let Some(m) = limits.millicpu {
        let (quota, period) = cfs_quota(m);
        resources["cpu"] = json!({ "quota": quota, "period": period });
    }
    all_mounts.extend(mounts.iter().map(|m| {
        let mut options = vec!["rbind", "rprivate", "nosuid", "nodev"];
        if m.read_only {
            options.push("ro");
        }
        json!({ "destination": m.destination, "type": "bind", "source": m.source, "options": options })
    }));
    let caps = &p.capabilities;
    // A non-root process keeps capabilities only in its bounding set (as containerd does), so
    // it cannot use them without executing a file that grants them.
    let effective: &[String] = if p.uid == 0 { caps } else { &[] };
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": { "uid": p.uid, "gid": p.gid, "additionalGids": p.additional_gids },
            "args": p.args,
            "env": p.env,
            "cwd": p.cwd,
            "capabilities": { "bounding": caps, "effective": effective, "permitted": effective, "inheritable": [], "ambient": [] },
            "noNewPrivileges": p.no_new_privileges,
        },
        "root": { "path": rootfs, "readonly": p.read_only_root },
        "hostname": hostname,
        "mounts": all_mounts,
        "linux": {
            "namespaces": [
                { "type": "pid" }, { "type": "ipc" }, { "type": "uts" }, { "type": "mount" }, { "type": "cgroup" },
                { "type": "network", "path": netns },
            ],
            "cgroupsPath": cgroups_path,
            "resources": resources,
            "maskedPaths": ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
                            "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
            "seccomp": p.runtime_default_seccomp.then(|| json!({
                "defaultAction": "SCMP_ACT_ALLOW",
                "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32", "SCMP_ARCH_AARCH64"],
                "syscalls": [{ "names": RUNTIME_DEFAULT_DENIED.as_slice(), "action": "SCMP_ACT_ERRNO", "errnoRet": libc::EPERM }],
            })),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(yaml: &str) -> (Pod, Container) {
        let pod: Pod = serde_json::from_value(serde_json::from_str::<Value>(yaml).unwrap()).unwrap();
        let c = pod.spec.as_ref().unwrap().containers[0].clone();
        (pod, c)
    }

    fn image() -> ImageConfig {
        ImageConfig {
            user: Some("65532:65532".into()),
            entrypoint: vec!["/kvgate-worker".into()],
            cmd: vec!["local".into()],
            env: vec!["PATH=/usr/bin:/bin".into()],
            working_dir: Some("/home/nonroot".into()),
        }
    }

    #[test]
    fn a_restricted_container_runs_as_its_user_with_nothing_granted() {
        let (pod, c) = pod(
            r#"{"metadata":{"name":"w"},"spec":{"securityContext":{"runAsNonRoot":true,"fsGroup":2000,"supplementalGroups":[3000],"seccompProfile":{"type":"RuntimeDefault"}},
               "containers":[{"name":"c","args":["prefill","--listen=$(POD_IP):8080"],
               "securityContext":{"allowPrivilegeEscalation":false,"readOnlyRootFilesystem":true,"capabilities":{"drop":["ALL"]}}}]}}"#,
        );
        let vars = [("POD_IP".to_string(), "10.0.0.2".to_string())].into();
        let p = process(&pod, &c, &image(), &vars).unwrap();
        assert_eq!(p.args, ["/kvgate-worker", "prefill", "--listen=10.0.0.2:8080"]);
        assert_eq!((p.uid, p.gid, p.additional_gids.clone()), (65532, 65532, vec![2000, 3000]));
        assert!(p.capabilities.is_empty() && p.no_new_privileges && p.read_only_root);
        assert!(
            p.env.contains(&"POD_IP=10.0.0.2".to_string()) && p.env.contains(&"HOSTNAME=w".to_string()) && p.env.contains(&"PATH=/usr/bin:/bin".to_string())
        );
        assert_eq!(p.cwd, "/home/nonroot");
        let s = spec(&p, "w", Path::new("/r"), &[], Path::new("/run/netns/x"), "c1", Limits { memory: Some(1 << 30), millicpu: Some(500) });
        assert_eq!(s["process"]["capabilities"]["bounding"], json!([]));
        assert_eq!(s["root"]["readonly"], true);
        assert_eq!(s["linux"]["namespaces"][5], json!({ "type": "network", "path": "/run/netns/x" }));
        assert_eq!(s["linux"]["resources"]["memory"]["limit"], 1u64 << 30);
        assert_eq!(s["linux"]["resources"]["cpu"], json!({ "quota": 50000, "period": 100000 }));
        assert!(s["linux"]["seccomp"]["syscalls"][0]["names"].as_array().unwrap().contains(&json!("mount")), "RuntimeDefault filters system calls");
    }

    #[test]
    fn command_replaces_the_entrypoint_and_the_image_cmd() {
        let (pod, c) = pod(r#"{"metadata":{"name":"w"},"spec":{"containers":[{"name":"c","command":["/kvgate-worker","--version"]}]}}"#);
        let p = process(&pod, &c, &image(), &BTreeMap::new()).unwrap();
        assert_eq!(p.args, ["/kvgate-worker", "--version"]);
        let (pod, c) = pod_default();
        assert_eq!(process(&pod, &c, &image(), &BTreeMap::new()).unwrap().args, ["/kvgate-worker", "local"]);
    }

    fn pod_default() -> (Pod, Container) {
        pod(r#"{"metadata":{"name":"w"},"spec":{"containers":[{"name":"c"}]}}"#)
    }

    #[test]
    fn defaults_capabilities_and_refuses_root_when_non_root_is_asked() {
        let (pod_, c) = pod_default();
        let p = process(&pod_, &c, &ImageConfig { user: None, ..image() }, &BTreeMap::new()).unwrap();
        assert_eq!((p.uid, p.capabilities.len()), (0, DEFAULT_CAPABILITIES.len()));
        assert!(p.capabilities.contains(&"CAP_NET_BIND_SERVICE".to_string()) && !p.no_new_privileges && !p.read_only_root);
        let (pod_, c) = pod(r#"{"metadata":{"name":"w"},"spec":{"containers":[{"name":"c","securityContext":{"runAsNonRoot":true,"runAsUser":0}}]}}"#);
        assert!(process(&pod_, &c, &image(), &BTreeMap::new()).unwrap_err().contains("runAsNonRoot"));
        let (pod_, c) = pod(
            r#"{"metadata":{"name":"w"},"spec":{"containers":[{"name":"c","securityContext":{"capabilities":{"drop":["ALL"],"add":["NET_BIND_SERVICE"]}}}]}}"#,
        );
        assert_eq!(process(&pod_, &c, &image(), &BTreeMap::new()).unwrap().capabilities, ["CAP_NET_BIND_SERVICE"]);
        let (pod_, c) = pod(
            r#"{"metadata":{"name":"w"},"spec":{"containers":[{"name":"c","securityContext":{"seccompProfile":{"type":"Localhost","localhostProfile":"x.json"}}}]}}"#,
        );
        assert!(process(&pod_, &c, &image(), &BTreeMap::new()).unwrap_err().contains("Localhost"));
    }
}
