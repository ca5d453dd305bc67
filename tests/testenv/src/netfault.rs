//! Network faults injected from outside the processes, as a flaky network would: a pod's link
//! (the host end of its veth, in the world's namespace) slowed with a token bucket or cut. No
//! process is told; no `--inject-fault` flag is involved.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};

use crate::netns;

/// The host end of one pod's veth.
#[derive(Debug)]
pub struct PodLink {
    pub name: String,
}

impl PodLink {
    /// The link of pod `uid`, from the node agent's record of its CNI result (`node_dir/UID/network.json`).
    pub fn of(node_dir: &Path, uid: &str) -> anyhow::Result<PodLink> {
        let path = node_dir.join(uid).join("network.json");
        let record: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?)?;
        let name = record["hostLink"].as_str().filter(|n| !n.is_empty()).with_context(|| format!("no hostLink in {record}"))?;
        Ok(PodLink { name: name.to_string() })
    }

    /// Traffic into the pod at most `kbit` kbit/s (queued, not dropped).
    pub fn limit_rate(&self, kbit: u32) -> anyhow::Result<()> {
        run("tc", &["qdisc", "replace", "dev", &self.name, "root", "tbf", "rate", &format!("{kbit}kbit"), "burst", "16kb", "latency", "60s"])
    }

    /// The link goes down: packets to and from the pod are dropped, connections stall.
    pub fn cut(&self) -> anyhow::Result<()> {
        run("ip", &["link", "set", "dev", &self.name, "down"])
    }

    /// Up again, at full speed.
    pub fn restore(&self) -> anyhow::Result<()> {
        run("ip", &["link", "set", "dev", &self.name, "up"])?;
        // No qdisc to delete is fine: the rate was never limited.
        let _ = run("tc", &["qdisc", "del", "dev", &self.name, "root"]);
        Ok(())
    }
}

/// Runs `ip`/`tc` in this process's namespace, which must be a test world's, never the host's.
fn run(program: &str, args: &[&str]) -> anyhow::Result<()> {
    netns::require()?;
    let out = Command::new(program).args(args).output().with_context(|| format!("running {program} (Debian package iproute2)"))?;
    if !out.status.success() {
        bail!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}
