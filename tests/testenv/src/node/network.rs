//! Pod networking through the CNI reference plugins, called as a kubelet's runtime calls them.
//!
//! Each pod gets a network namespace held open by a sandbox process (`sleep infinity` unshared
//! into a new namespace, the part a pause container plays), then `loopback` brings its `lo` up and
//! `bridge` (with `host-local` IPAM) plugs a veth into the `kvgate0` bridge of the node's namespace
//! and gives it an address from the node's pod CIDR (`--pod-cidr`). The bridge holds the CIDR's
//! first address, the pods' gateway: through it they reach the node, and through the node's own
//! routes the other nodes and the API server (`kvgate_testenv::fabric`). Containers `setns` into
//! the sandbox's namespace before exec. DEL releases the address when the pod goes.

use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, bail};
use serde_json::{Value, json};

pub const BRIDGE: &str = "kvgate0";

/// Where `make tools` builds the plugins (override with `KVGATE_CNI_BIN`).
pub fn default_bin_dir() -> PathBuf {
    std::env::var_os("KVGATE_CNI_BIN").map(PathBuf::from).unwrap_or_else(|| crate::paths::target("cni/bin"))
}

#[derive(Debug)]
pub struct PodNetwork {
    bin: PathBuf,
    node_ip: Ipv4Addr,
    gateway: Ipv4Addr,
    bridge: Value,
    loopback: Value,
}

/// A pod's network namespace and its address.
#[derive(Debug)]
pub struct Sandbox {
    pub ip: Ipv4Addr,
    /// The node's address (the pod's `status.hostIP`).
    pub host_ip: Ipv4Addr,
    /// The bridge's address: the pod's gateway, and its DNS server (`dns`).
    pub gateway: Ipv4Addr,
    /// The host end of the pod's veth, in the node's namespace.
    pub host_link: String,
    /// `/proc/<sandbox pid>/ns/net`, the `CNI_NETNS` of the pod.
    pub netns: PathBuf,
    id: String,
    holder: Child,
}

impl PodNetwork {
    /// Checks that the plugins are there; pods get addresses from `pod_cidr` (the bridge holds
    /// its first one), IPAM state lives under `dir`.
    pub fn new(bin: PathBuf, dir: &Path, pod_cidr: &str, node_ip: Ipv4Addr) -> anyhow::Result<Self> {
        for plugin in ["bridge", "host-local", "loopback"] {
            if !bin.join(plugin).is_file() {
                bail!("CNI plugin {} not found: build the reference plugins with `make tools` (tests/cni/build.sh)", bin.join(plugin).display());
            }
        }
        let gateway = first_address(pod_cidr)?;
        let bridge = json!({
            "cniVersion": "1.0.0", "name": "kvgate", "type": "bridge", "bridge": BRIDGE,
            "isGateway": true, "ipMasq": false, "hairpinMode": true,
            "ipam": { "type": "host-local", "dataDir": dir.join("ipam"), "ranges": [[{ "subnet": pod_cidr, "gateway": gateway }]],
                      // Everything beyond the bridge (other nodes, the API server) through the node.
                      "routes": [{ "dst": "0.0.0.0/0" }] },
        });
        let loopback = json!({ "cniVersion": "1.0.0", "name": "kvgate-lo", "type": "loopback" });
        Ok(PodNetwork { bin, node_ip, gateway, bridge, loopback })
    }

    /// A new namespace for pod `id`, wired to the bridge.
    pub fn add(&self, id: &str) -> anyhow::Result<Sandbox> {
        let holder = crate::netns::holder("the pod")?;
        let netns = PathBuf::from(format!("/proc/{}/ns/net", holder.id()));
        let mut sandbox =
            Sandbox { ip: Ipv4Addr::UNSPECIFIED, host_ip: self.node_ip, gateway: self.gateway, host_link: String::new(), netns, id: id.to_string(), holder };
        let wired = self.call("ADD", &self.loopback, &sandbox, "lo").and_then(|_| self.call("ADD", &self.bridge, &sandbox, "eth0"));
        match wired.and_then(|result| parse_result(&result)) {
            Ok((ip, host_link)) => {
                sandbox.ip = ip;
                sandbox.host_link = host_link;
                Ok(sandbox)
            }
            Err(e) => {
                self.del(sandbox);
                Err(e)
            }
        }
    }

    /// Releases the pod's address and ends its namespace.
    pub fn del(&self, mut sandbox: Sandbox) {
        if let Err(e) = self.call("DEL", &self.bridge, &sandbox, "eth0") {
            tracing::warn!(pod = sandbox.id, error = %e, "CNI DEL failed");
        }
        let _ = sandbox.holder.kill();
        let _ = sandbox.holder.wait();
    }

    /// One plugin call: the CNI spec's environment, the network config on stdin, the result on stdout.
    fn call(&self, command: &str, config: &Value, sandbox: &Sandbox, ifname: &str) -> anyhow::Result<Value> {
        let plugin = config["type"].as_str().unwrap_or_default();
        let mut child = Command::new(self.bin.join(plugin))
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", &sandbox.id)
            .env("CNI_NETNS", &sandbox.netns)
            .env("CNI_IFNAME", ifname)
            .env("CNI_PATH", &self.bin)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("running CNI plugin {plugin}"))?;
        child.stdin.take().expect("piped").write_all(config.to_string().as_bytes())?;
        let out = child.wait_with_output()?;
        let result: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        if !out.status.success() {
            // CNI errors are `{"code": N, "msg": ..., "details": ...}` on stdout.
            bail!("CNI {command} {plugin} for {}: {} {} {}", sandbox.id, result["msg"], result["details"], String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(result)
    }
}

/// The first host address of `cidr` (`198.18.1.0/24` gives 198.18.1.1).
pub fn first_address(cidr: &str) -> anyhow::Result<Ipv4Addr> {
    let (net, bits) = cidr.split_once('/').with_context(|| format!("pod CIDR {cidr}: expected ADDRESS/BITS"))?;
    let (net, bits): (Ipv4Addr, u32) = (net.parse().with_context(|| format!("pod CIDR {cidr}"))?, bits.parse().with_context(|| format!("pod CIDR {cidr}"))?);
    if !(8..=30).contains(&bits) {
        bail!("pod CIDR {cidr}: the prefix must be 8 to 30 bits long");
    }
    let mask = u32::MAX << (32 - bits);
    Ok(Ipv4Addr::from((u32::from(net) & mask) + 1))
}

/// The pod's address and the veth's host end from a bridge ADD result.
fn parse_result(result: &Value) -> anyhow::Result<(Ipv4Addr, String)> {
    let cidr = result["ips"][0]["address"].as_str().with_context(|| format!("no address in the CNI result {result}"))?;
    let ip = cidr.split('/').next().unwrap_or_default().parse().with_context(|| format!("CNI address {cidr}"))?;
    let host_link = result["interfaces"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|i| i["sandbox"].is_null() && i["name"] != BRIDGE)
        .and_then(|i| i["name"].as_str())
        .unwrap_or_default()
        .to_string();
    Ok((ip, host_link))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_address_and_host_veth_of_a_bridge_result() {
        let result = json!({
            "cniVersion": "1.0.0",
            "interfaces": [
                { "name": "kvgate0", "mac": "aa:bb:cc:dd:ee:ff" },
                { "name": "veth1234abcd", "mac": "aa:bb:cc:dd:ee:01" },
                { "name": "eth0", "mac": "aa:bb:cc:dd:ee:02", "sandbox": "/proc/42/ns/net" },
            ],
            "ips": [{ "interface": 2, "address": "198.18.0.5/15", "gateway": "198.18.0.1" }],
        });
        assert_eq!(parse_result(&result).unwrap(), ("198.18.0.5".parse().unwrap(), "veth1234abcd".to_string()));
    }

    #[test]
    fn the_gateway_is_the_first_address_of_the_pod_cidr() {
        assert_eq!(first_address("198.18.3.0/24").unwrap(), Ipv4Addr::new(198, 18, 3, 1));
        assert_eq!(first_address("10.1.2.77/16").unwrap(), Ipv4Addr::new(10, 1, 0, 1));
        assert!(first_address("198.18.3.0").unwrap_err().to_string().contains("ADDRESS/BITS"));
        assert!(first_address("198.18.3.0/31").unwrap_err().to_string().contains("8 to 30"));
    }
}
