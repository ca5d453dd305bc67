//! runc, the OCI runtime the node agent runs containers with: `runc run` in the foreground (its
//! exit status is the container's, 128 + the signal for a killed one; it removes the container
//! and its cgroup when the container exits), `runc kill` to signal the container's init (a signal
//! to runc itself is forwarded, but SIGKILL cannot be), `runc delete --force` to clean up after a
//! runc that did not exit cleanly. State lives under the agent's own `--root`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

#[derive(Debug, Clone)]
pub struct Runc {
    root: PathBuf,
}

impl Runc {
    /// Fails with how to install runc when it is missing.
    pub fn new(root: PathBuf) -> Result<Runc, String> {
        let ok = Command::new("runc").arg("--version").stdout(Stdio::null()).status().is_ok_and(|s| s.success());
        if !ok {
            return Err("runc not found: install it with `apt-get install runc` (make test-deps does)".into());
        }
        Ok(Runc { root })
    }

    /// `runc run` of the bundle in `bundle` as container `id`; the caller sets stdio and spawns.
    pub fn run(&self, bundle: &Path, id: &str) -> Command {
        let mut cmd = Command::new("runc");
        cmd.arg("--root").arg(&self.root).args(["run", "--bundle"]).arg(bundle).arg(id);
        cmd
    }

    /// Sends `signal` (e.g. "TERM", "KILL") to the container's init.
    pub fn kill(&self, id: &str, signal: &str) -> Result<(), String> {
        let out = Command::new("runc").arg("--root").arg(&self.root).args(["kill", id, signal]).output().map_err(|e| format!("runc: {e}"))?;
        if out.status.success() { Ok(()) } else { Err(String::from_utf8_lossy(&out.stderr).trim().to_string()) }
    }

    /// Removes what is left of container `id` (nothing, after a clean exit).
    pub fn delete(&self, id: &str) {
        let _ = Command::new("runc").arg("--root").arg(&self.root).args(["delete", "--force", id]).stderr(Stdio::null()).status();
    }
}
