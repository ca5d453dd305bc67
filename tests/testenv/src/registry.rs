//! The test world's image registry: the CNCF distribution registry (`make tools` builds v3.1.2
//! from its Go module), serving plain HTTP on port [`PORT`] of the world's network namespace.
//! The test process reaches it at `127.0.0.1:5000`; nodes and pods at `198.19.0.1:5000`
//! ([`host`]). kvgate's images are pushed to it by `scripts/push.sh`, the script behind
//! `make push`, and node agents pull them by reference as a kubelet does, with the registry as
//! their mirror of `ghcr.io` (what containerd's `hosts.toml` gives an air-gapped node): the
//! chart's defaults and the examples (`ghcr.io/kvgate/...`) are pulled from it as they stand.
//!
//! Its storage is `target/registry/`, shared by every test process (registries may share a
//! storage backend): a blob pushed by an earlier run is not sent again.

use std::path::Path;
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::paths::root;
use crate::process::{Proc, tail};
use crate::tools::tool;

/// The registry's port in the world's namespace (its own: no other process of the host sees it).
pub const PORT: u16 = 5000;
/// The registry whose images the world's registry mirrors.
pub const MIRRORED: &str = "ghcr.io";

/// Where nodes and pods reach the registry: `198.19.0.1:5000`.
pub fn host() -> String {
    format!("{}:{PORT}", crate::fabric::WORLD)
}

/// Where the test process itself pushes.
pub fn local() -> String {
    format!("127.0.0.1:{PORT}")
}

/// The node agent's flags for this registry: reached over HTTP, and the mirror of [`MIRRORED`].
pub fn node_flags() -> Vec<String> {
    vec!["--insecure-registry".into(), host(), "--registry-mirror".into(), format!("{MIRRORED}={}", host())]
}

pub struct Registry {
    _proc: Mutex<Proc>,
}

/// The registry of this test process's world, started on first use.
pub fn shared() -> anyhow::Result<&'static Registry> {
    static SHARED: OnceLock<Result<Registry, String>> = OnceLock::new();
    SHARED.get_or_init(|| start().map_err(|e| format!("{e:#}"))).as_ref().map_err(|e| anyhow::anyhow!("the test world's registry: {e}"))
}

fn start() -> anyhow::Result<Registry> {
    crate::netns::require()?;
    let bin = tool("registry")?;
    let storage = root().join("target/registry");
    let dir = storage.join("run");
    std::fs::create_dir_all(&dir)?;
    sweep(&dir);
    let config = dir.join(format!("config-{}.yml", std::process::id()));
    // Listening on every address of the world's namespace: 127.0.0.1 for the test process, the
    // fabric's address for nodes (added once the first node starts).
    std::fs::write(
        &config,
        format!(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: 0.0.0.0:{PORT}\n",
            storage.join("data").display()
        ),
    )?;
    let mut proc = Proc::spawn(&format!("registry-{}", std::process::id()), &bin, &["serve".into(), config.display().to_string()], &dir)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while crate::http::get(&format!("http://{}/v2/", local())).is_none() {
        proc.check_alive().map_err(|e| anyhow::anyhow!("{e:#}\n{}", tail(&proc.log, 30)))?;
        anyhow::ensure!(Instant::now() < deadline, "the registry did not answer /v2/ within 30 s:\n{}", tail(&proc.log, 30));
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(Registry { _proc: Mutex::new(proc) })
}

/// Removes the configurations and logs of registries whose test process has exited (each is
/// named for its process: `config-PID.yml`, `registry-PID.log`).
fn sweep(dir: &Path) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = name.strip_prefix("config-").or_else(|| name.strip_prefix("registry-")).and_then(|r| r.split('.').next()).and_then(|p| p.parse::<i32>().ok());
        if pid.is_some_and(|pid| !crate::process::alive(pid)) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

impl Registry {
    /// Pushes `images` (kvgate-operator, kvgate-worker, llamacpp, vllm) from the layouts under
    /// `from` with `scripts/push.sh`, as `make push` does, to `kvgate/NAME:TAG`.
    pub fn push(&self, from: &Path, images: &[&str]) -> anyhow::Result<()> {
        let out = Command::new("bash")
            .arg(root().join("scripts/push.sh"))
            .arg(format!("{}/kvgate", local()))
            .arg("--from")
            .arg(from)
            .args(["--insecure", "--no-chart"])
            .args(images)
            .output()
            .context("running scripts/push.sh")?;
        anyhow::ensure!(out.status.success(), "scripts/push.sh failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
        Ok(())
    }

    /// Pushes the tag `tag` of the OCI layout `layout` as `kvgate/NAME:TO`.
    pub fn push_tag(&self, layout: &Path, tag: &str, name: &str, to: &str) -> anyhow::Result<()> {
        let out = Command::new("skopeo")
            .args(["copy", "-q", "--insecure-policy", "--dest-tls-verify=false"])
            .arg(format!("oci:{}:{tag}", layout.display()))
            .arg(format!("docker://{}/kvgate/{name}:{to}", local()))
            .output()
            .context("running skopeo (apt-get install skopeo, or make test-deps)")?;
        anyhow::ensure!(out.status.success(), "skopeo copy {}:{tag} to the registry: {}", layout.display(), String::from_utf8_lossy(&out.stderr).trim());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_files_of_registries_whose_process_exited_are_swept() {
        let dir = std::env::temp_dir().join(format!("kvgate-registry-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (gone, mine) = (i32::MAX, std::process::id());
        let names =
            [format!("config-{gone}.yml"), format!("registry-{gone}.log"), format!("config-{mine}.yml"), format!("registry-{mine}.log"), "other".into()];
        for n in &names {
            std::fs::write(dir.join(n), "").unwrap();
        }
        super::sweep(&dir);
        let mut left: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        left.sort();
        assert_eq!(left, [names[2].clone(), "other".into(), names[3].clone()]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn nodes_reach_the_registry_on_the_worlds_fabric_address() {
        assert_eq!(super::host(), "198.19.0.1:5000");
        assert_eq!(super::node_flags()[3], "ghcr.io=198.19.0.1:5000");
    }
}
