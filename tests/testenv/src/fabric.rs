//! The test world's machines and the network between them.
//!
//! Each node is a network namespace of its own (held open by a sandbox process, as a pod's is)
//! in which its node agent, its pod bridge and its pods live. Its `eth0` is one end of a veth
//! whose other end is plugged into the `kvfabric` bridge of the world's namespace (`netns`),
//! which holds [`WORLD`]: the API server and every other process of the world are reached there,
//! by nodes and pods alike. The world's namespace is also the router between the machines: every
//! packet from one node's pods to another's crosses it, so that is where a partition is made
//! (`ip rule ... blackhole`) and where a node's link is shaped (`tc` on its veth). Nothing here
//! touches the host's namespace.
//!
//! Addresses (RFC 2544 benchmarking space, never routed): the fabric is 198.19.0.0/24, node `i`
//! (1..=[`MAX_NODES`]) is 198.19.0.(10+i) and its pods are 198.18.i.0/24 behind 198.18.i.1.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Mutex;

use anyhow::{Context, bail};

use crate::netns;

/// The world's address on the fabric: where nodes and pods reach the API server and the rest.
pub const WORLD: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 1);
const FABRIC_PREFIX: u8 = 24;
const FABRIC_BRIDGE: &str = "kvfabric";
pub const MAX_NODES: u8 = 32;

/// Node `index`'s address on the fabric.
pub fn node_ip(index: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 19, 0, 10 + index)
}

/// Node `index`'s pod CIDR (its bridge holds the first address).
pub fn pod_cidr(index: u8) -> String {
    format!("198.18.{index}.0/24")
}

/// Every node address a kubelet serving certificate is issued for.
pub fn all_node_ips() -> impl Iterator<Item = Ipv4Addr> {
    (1..=MAX_NODES).map(node_ip)
}

/// One machine's namespace, plugged into the fabric. Dropping it ends the namespace (once the
/// processes inside are gone) and with it the veth: the machine is off the network.
#[derive(Debug)]
pub struct Machine {
    pub index: u8,
    pub ip: Ipv4Addr,
    /// `/proc/<holder>/ns/net`: run a process here with `nsenter --net=...`.
    pub netns: PathBuf,
    /// The fabric end of the machine's veth, in the world's namespace.
    pub link: String,
    holder: Child,
}

impl Machine {
    /// A new namespace for node `index`, wired to the fabric (created on first use), with its
    /// address, a default route through the world and forwarding on (its pods' traffic passes
    /// through it); the world routes the node's pod CIDR to it.
    pub fn start(index: u8) -> anyhow::Result<Machine> {
        netns::require()?;
        if !(1..=MAX_NODES).contains(&index) {
            bail!("node index {index} is outside 1..={MAX_NODES}");
        }
        fabric()?;
        let holder = crate::netns::holder("the node")?;
        let netns = PathBuf::from(format!("/proc/{}/ns/net", holder.id()));
        let (link, ip) = (format!("kvnode{index}"), node_ip(index));
        let machine = Machine { index, ip, netns, link, holder };
        machine.wire().with_context(|| format!("wiring node {index} to the fabric"))?;
        Ok(machine)
    }

    fn wire(&self) -> anyhow::Result<()> {
        let pid = self.holder.id().to_string();
        let _ = ip(None, &["link", "del", &self.link]);
        ip(None, &["link", "add", &self.link, "type", "veth", "peer", "name", "eth0", "netns", &pid])?;
        ip(None, &["link", "set", &self.link, "master", FABRIC_BRIDGE, "up"])?;
        let ns = Some(self.netns.as_path());
        ip(ns, &["link", "set", "lo", "up"])?;
        ip(ns, &["addr", "add", &format!("{}/{FABRIC_PREFIX}", self.ip), "dev", "eth0"])?;
        ip(ns, &["link", "set", "eth0", "up"])?;
        ip(ns, &["route", "add", "default", "via", &WORLD.to_string()])?;
        sysctl(ns, "net/ipv4/ip_forward", "1")?;
        ip(None, &["route", "replace", &pod_cidr(self.index), "via", &self.ip.to_string(), "dev", FABRIC_BRIDGE])
    }

    /// Traffic into this machine at most `kbit` kbit/s with a `burst_kb` bucket (queued, not
    /// dropped): a slow link between it and the rest.
    pub fn shape(&self, kbit: u32, burst_kb: u32) -> anyhow::Result<()> {
        limit_rate(None, &self.link, kbit, burst_kb)
    }

    /// The link at full speed again.
    pub fn unshape(&self) -> anyhow::Result<()> {
        ip_tool("tc", None, &["qdisc", "del", "dev", &self.link, "root"])
    }

    /// Runs `program args` inside this machine's namespace (e.g. `tc` on a pod's veth).
    pub fn run(&self, program: &str, args: &[&str]) -> anyhow::Result<()> {
        ip_tool(program, Some(&self.netns), args)
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// What leaves `dev` (in `ns`, the world's namespace when `None`) at most `kbit` kbit/s with a
/// `burst_kb` token bucket (`tc tbf`: queued, not dropped).
pub fn limit_rate(ns: Option<&Path>, dev: &str, kbit: u32, burst_kb: u32) -> anyhow::Result<()> {
    let (rate, burst) = (format!("{kbit}kbit"), format!("{burst_kb}kb"));
    ip_tool("tc", ns, &["qdisc", "replace", "dev", dev, "root", "tbf", "rate", &rate, "burst", &burst, "latency", "60s"])
}

/// Pods of `a` and pods of `b` can no longer reach each other (packets silently dropped, both
/// ways, as a broken link between two racks would); both machines still reach the world.
pub fn partition(a: &Machine, b: &Machine) -> anyhow::Result<()> {
    for (from, to) in [(a, b), (b, a)] {
        let (src, dst) = (pod_cidr(from.index), pod_cidr(to.index));
        ip(None, &["rule", "add", "from", &src, "to", &dst, "blackhole", "priority", &rule_priority(from, to)])?;
    }
    Ok(())
}

/// Undoes `partition(a, b)`.
pub fn heal(a: &Machine, b: &Machine) -> anyhow::Result<()> {
    for (from, to) in [(a, b), (b, a)] {
        ip(None, &["rule", "del", "priority", &rule_priority(from, to)])?;
    }
    Ok(())
}

/// One rule per ordered pair, so heal removes exactly what partition added.
fn rule_priority(from: &Machine, to: &Machine) -> String {
    (1000 + u32::from(from.index) * 100 + u32::from(to.index)).to_string()
}

/// The fabric bridge in the world's namespace, once; forwarding on (the world routes between
/// the machines) and redirects off (a node told to go straight to another would bypass the
/// world, and its partitions).
fn fabric() -> anyhow::Result<()> {
    static DONE: Mutex<bool> = Mutex::new(false);
    let mut done = DONE.lock().unwrap();
    if *done {
        return Ok(());
    }
    ip(None, &["link", "add", FABRIC_BRIDGE, "type", "bridge"])?;
    ip(None, &["addr", "add", &format!("{WORLD}/{FABRIC_PREFIX}"), "dev", FABRIC_BRIDGE])?;
    ip(None, &["link", "set", FABRIC_BRIDGE, "up"])?;
    sysctl(None, "net/ipv4/ip_forward", "1")?;
    for conf in ["all", "default", FABRIC_BRIDGE] {
        sysctl(None, &format!("net/ipv4/conf/{conf}/send_redirects"), "0")?;
    }
    *done = true;
    Ok(())
}

fn ip(ns: Option<&Path>, args: &[&str]) -> anyhow::Result<()> {
    ip_tool("ip", ns, args)
}

/// `program args` in the world's namespace, or in `ns` through `nsenter` (util-linux).
fn ip_tool(program: &str, ns: Option<&Path>, args: &[&str]) -> anyhow::Result<()> {
    netns::require()?;
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net={}", ns.display())).arg(program);
            c
        }
        None => Command::new(program),
    };
    let out = cmd.args(args).output().with_context(|| format!("running {program} (Debian packages iproute2, util-linux)"))?;
    if !out.status.success() {
        bail!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Writes `/proc/sys/<key>` as seen from `ns` (the world's namespace when `None`): those files
/// belong to the reader's network namespace.
fn sysctl(ns: Option<&Path>, key: &str, value: &str) -> anyhow::Result<()> {
    ip_tool("sh", ns, &["-c", &format!("echo {value} > /proc/sys/{key}")])
}
