//! Network faults injected from outside the processes, as a flaky network would: a pod's link
//! (the host end of its veth, in its node's namespace) slowed with a token bucket or cut. No
//! process is told; no fault injected into the worker is involved. Faults between whole machines (a
//! shaped link, a partition) are `fabric`'s.

use anyhow::Context;

use crate::fabric::Machine;
use crate::nodes::Node;

/// The host end of one pod's veth.
#[derive(Debug)]
pub struct PodLink<'n> {
    pub name: String,
    machine: &'n Machine,
}

impl<'n> PodLink<'n> {
    /// The link of pod `uid` on `node`, from the node agent's record of its CNI result
    /// (`node.dir/UID/network.json`).
    pub fn of(node: &'n Node, uid: &str) -> anyhow::Result<PodLink<'n>> {
        let path = node.dir.join(uid).join("network.json");
        let record: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?)?;
        let name = record["hostLink"].as_str().filter(|n| !n.is_empty()).with_context(|| format!("no hostLink in {record}"))?;
        Ok(PodLink { name: name.to_string(), machine: &node.machine })
    }

    /// Traffic into the pod at most `kbit` kbit/s (queued, not dropped).
    pub fn limit_rate(&self, kbit: u32) -> anyhow::Result<()> {
        crate::fabric::limit_rate(Some(&self.machine.netns), &self.name, kbit, 16)
    }

    /// The link goes down: packets to and from the pod are dropped, connections stall.
    pub fn cut(&self) -> anyhow::Result<()> {
        self.machine.run("ip", &["link", "set", "dev", &self.name, "down"])
    }

    /// Up again, at full speed.
    pub fn restore(&self) -> anyhow::Result<()> {
        self.machine.run("ip", &["link", "set", "dev", &self.name, "up"])?;
        // No qdisc to delete is fine: the rate was never limited.
        let _ = self.machine.run("tc", &["qdisc", "del", "dev", &self.name, "root"]);
        Ok(())
    }
}
