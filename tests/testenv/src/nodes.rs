//! A node of the test world: a machine on the fabric (`fabric::Machine`) with a node agent
//! running inside its namespace.

use std::path::PathBuf;

use crate::fabric::Machine;
use crate::process::Proc;

/// What the node offers the scheduler (its `allocatable`).
#[derive(Debug, Clone)]
pub struct Resources {
    pub cpu: String,
    pub memory: String,
    pub ephemeral_storage: String,
}

impl Default for Resources {
    fn default() -> Self {
        Resources { cpu: "16".into(), memory: "64Gi".into(), ephemeral_storage: "100Gi".into() }
    }
}

/// A running node. Dropping it stops the agent the polite way (SIGTERM: it tears its pods down),
/// then ends the machine's namespace.
#[derive(Debug)]
pub struct Node {
    pub name: String,
    /// Where the agent keeps its pods' files (one directory per pod UID).
    pub dir: PathBuf,
    // Declared before `machine`: the agent stops before its namespace goes.
    agent: Proc,
    pub machine: Machine,
}

impl Node {
    pub(crate) fn new(name: &str, dir: PathBuf, agent: Proc, machine: Machine) -> Node {
        Node { name: name.to_string(), dir, agent, machine }
    }

    /// The machine dies: SIGKILL to the agent's process group (the agent and every process of
    /// its pods: sandboxes, runc and its containers, host processes), then its namespace ends
    /// and its link with it. Nothing is told and nothing cleans up: the Node stops heartbeating
    /// and its pods' addresses stop answering, as when a machine loses power.
    pub fn power_off(mut self) {
        self.agent.kill();
    }

    /// Fails with the agent's log tail if it exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        self.agent.check_alive()
    }

    /// The agent's process id (its mount namespace holds the writable roots' overlays).
    pub fn agent_pid(&self) -> u32 {
        self.agent.pid()
    }

    /// The agent's log.
    pub fn log(&self) -> &std::path::Path {
        &self.agent.log
    }

    /// Resident memory, in bytes, of each running container's process on this node, by runc
    /// container id (`kvgate-ctr-<agent>-<pod uid>-<container>`).
    pub fn container_rss(&self) -> Vec<(String, u64)> {
        let out = std::process::Command::new("runc").arg("--root").arg(self.dir.join("runc")).args(["list", "--format", "json"]).output();
        let list: serde_json::Value = out.ok().and_then(|o| serde_json::from_slice(&o.stdout).ok()).unwrap_or_default();
        list.as_array()
            .into_iter()
            .flatten()
            .filter(|c| c["status"] == "running")
            .filter_map(|c| Some((c["id"].as_str()?.to_string(), rss(c["pid"].as_i64()?)?)))
            .collect()
    }
}

/// `VmRSS` of process `pid`, in bytes.
pub fn rss(pid: i64) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}
