//! Pod IPs: one non-loopback /32 per pod, added to the host's `lo`.
//!
//! The API server refuses loopback addresses in EndpointSlices, so pods on 127.0.0.N could never
//! be behind a Service. Any address on `lo` is still local, so every pod and the host reach each
//! other with no routes or namespaces; each pod binds its own address (`$(POD_IP)`). Addresses come
//! from 198.18.0.0/15 (RFC 2544 benchmarking space: never routed, so shadowing it on `lo` cannot
//! cut the machine off from a real host). Each address carries the label `lo:kv<pid>` of the agent
//! that added it, so a later agent can remove what a killed one left behind. Needs CAP_NET_ADMIN.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::process::Command;

pub struct PodAddresses {
    label: String,
    held: BTreeSet<Ipv4Addr>,
}

impl PodAddresses {
    /// Checks that addresses can be added here and sweeps those of agents that no longer run.
    pub fn new() -> anyhow::Result<Self> {
        let me = PodAddresses { label: format!("lo:kv{}", std::process::id()), held: BTreeSet::new() };
        for (addr, label) in lo_addresses()? {
            let owner = label.strip_prefix("lo:kv").and_then(|p| p.parse::<i32>().ok());
            // SAFETY: kill with signal 0 only checks whether the pid exists.
            if let Some(pid) = owner.filter(|&p| unsafe { libc::kill(p, 0) } != 0) {
                tracing::info!(%addr, pid, "removing a pod address left by an agent that exited");
                let _ = ip(&["addr", "del", &format!("{addr}/32"), "dev", "lo"]);
            }
        }
        Ok(me)
    }

    /// A fresh address, unused by any interface of this machine.
    pub fn take(&mut self) -> anyhow::Result<Ipv4Addr> {
        let in_use: BTreeSet<Ipv4Addr> = all_addresses()?;
        for n in 1u32..(1 << 17) - 1 {
            let addr = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + n);
            if addr.octets()[3] == 0 || addr.octets()[3] == 255 || in_use.contains(&addr) || self.held.contains(&addr) {
                continue;
            }
            match ip(&["addr", "add", &format!("{addr}/32"), "dev", "lo", "label", &self.label]) {
                Ok(()) => {
                    self.held.insert(addr);
                    return Ok(addr);
                }
                // Another agent took it between our listing and now.
                Err(e) if e.to_string().contains("File exists") => continue,
                Err(e) => return Err(e),
            }
        }
        anyhow::bail!("no free pod address left in 198.18.0.0/15")
    }

    pub fn release(&mut self, addr: Ipv4Addr) {
        if self.held.remove(&addr)
            && let Err(e) = ip(&["addr", "del", &format!("{addr}/32"), "dev", "lo"])
        {
            tracing::warn!(%addr, error = %e, "could not remove a pod address");
        }
    }
}

impl Drop for PodAddresses {
    fn drop(&mut self) {
        for addr in std::mem::take(&mut self.held) {
            let _ = ip(&["addr", "del", &format!("{addr}/32"), "dev", "lo"]);
        }
    }
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip").args(args).output().map_err(|e| anyhow::anyhow!("running `ip` (Debian package iproute2): {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
    if err.contains("Operation not permitted") {
        anyhow::bail!("`ip {}`: {err}: the node agent gives each pod its own address on lo and needs CAP_NET_ADMIN (run the tests as root)", args.join(" "));
    }
    anyhow::bail!("`ip {}`: {err}", args.join(" "))
}

/// `(address, label)` of every IPv4 address on `lo`.
fn lo_addresses() -> anyhow::Result<Vec<(Ipv4Addr, String)>> {
    Ok(list(&["-o", "-4", "addr", "show", "dev", "lo"])?.into_iter().collect())
}

fn all_addresses() -> anyhow::Result<BTreeSet<Ipv4Addr>> {
    Ok(list(&["-o", "-4", "addr", "show"])?.into_iter().map(|(a, _)| a).collect())
}

/// Parses `ip -o -4 addr` lines: `1: lo    inet 198.18.0.1/32 scope global lo:kv42\  valid_lft ...`.
fn list(args: &[&str]) -> anyhow::Result<Vec<(Ipv4Addr, String)>> {
    let out = Command::new("ip").args(args).output().map_err(|e| anyhow::anyhow!("running `ip` (Debian package iproute2): {e}"))?;
    Ok(parse(&String::from_utf8_lossy(&out.stdout)))
}

fn parse(text: &str) -> Vec<(Ipv4Addr, String)> {
    text.lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let at = words.iter().position(|w| *w == "inet")?;
            let addr = words.get(at + 1)?.split('/').next()?.parse().ok()?;
            // The label is the word that ends the address part with a `\`.
            let label = words.iter().find(|w| w.ends_with('\\')).map(|w| w.trim_end_matches('\\').to_string()).unwrap_or_default();
            Some((addr, label))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ip_addr_output_with_labels() {
        let text = "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever\n\
                    1: lo    inet 198.18.0.7/32 scope global lo:kv4242\\       valid_lft forever preferred_lft forever\n";
        assert_eq!(parse(text), vec![("127.0.0.1".parse().unwrap(), "lo".to_string()), ("198.18.0.7".parse().unwrap(), "lo:kv4242".to_string())]);
    }
}
