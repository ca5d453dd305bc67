//! How many pages the pool gets: from a byte budget, a token count, or a fraction of the memory
//! this process may really use (the cgroup limit of a pod, not the host's total).

use std::fs;

use thiserror::Error;

use super::KvLayout;

/// The pool size as the operator asked for it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PoolSize {
    Bytes(u64),
    Tokens(u64),
    /// Fraction (0, 1] of the memory available to this process after the model is loaded.
    MemoryFraction(f64),
}

#[derive(Debug, Error, PartialEq)]
pub enum SizingError {
    #[error("--kv-memory-fraction must be in (0, 1], got {0}")]
    BadFraction(f64),
    #[error("KV pool of {requested} bytes is smaller than one page ({page_bytes} bytes)")]
    BelowOnePage { requested: u64, page_bytes: u64 },
    #[error("could not read available memory: {0}")]
    NoMemInfo(String),
}

impl PoolSize {
    /// Whole pages for this request; never rounds up past the budget.
    pub fn pages(&self, layout: &KvLayout, available_bytes: impl FnOnce() -> Result<u64, SizingError>) -> Result<usize, SizingError> {
        let page_bytes = layout.page_bytes() as u64;
        let budget = match *self {
            PoolSize::Tokens(t) => return Ok(layout.pages_for(t as usize)),
            PoolSize::Bytes(b) => b,
            PoolSize::MemoryFraction(f) => {
                if !(f > 0.0 && f <= 1.0) {
                    return Err(SizingError::BadFraction(f));
                }
                (available_bytes()? as f64 * f) as u64
            }
        };
        if budget < page_bytes {
            return Err(SizingError::BelowOnePage { requested: budget, page_bytes });
        }
        Ok((budget / page_bytes) as usize)
    }
}

/// Bytes this process can still allocate: the smaller of the host's `MemAvailable` and what the
/// cgroup (v2 or v1) limit leaves.
pub fn available_host_memory() -> Result<u64, SizingError> {
    let meminfo = fs::read_to_string("/proc/meminfo").map_err(|e| SizingError::NoMemInfo(e.to_string()))?;
    let host = parse_meminfo_available(&meminfo).ok_or_else(|| SizingError::NoMemInfo("no MemAvailable in /proc/meminfo".into()))?;
    Ok(match cgroup_headroom() {
        Some(room) => host.min(room),
        None => host,
    })
}

fn parse_meminfo_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Limit minus usage of this process's memory cgroup, if it has a limit. The cgroup is the one
/// `/proc/self/cgroup` names (in a container with its own cgroup namespace that is the root of
/// the mount; a kubelet without one, like the test node agent, leaves the full path).
fn cgroup_headroom() -> Option<u64> {
    let read = |p: String| fs::read_to_string(p).ok();
    let own = read("/proc/self/cgroup".into()).unwrap_or_default();
    let (limit, usage) = match own_cgroup(&own, "") {
        Some(dir) if fs::metadata(format!("/sys/fs/cgroup{dir}/memory.max")).is_ok() => {
            (read(format!("/sys/fs/cgroup{dir}/memory.max"))?, read(format!("/sys/fs/cgroup{dir}/memory.current"))?)
        }
        _ => {
            let dir = own_cgroup(&own, "memory").unwrap_or_default();
            (read(format!("/sys/fs/cgroup/memory{dir}/memory.limit_in_bytes"))?, read(format!("/sys/fs/cgroup/memory{dir}/memory.usage_in_bytes"))?)
        }
    };
    headroom(&limit, &usage)
}

/// This process's cgroup path for a v1 `controller` ("" for the v2 entry), from `/proc/self/cgroup`
/// lines `ID:CONTROLLERS:PATH`; "/" comes back as "".
fn own_cgroup(proc_self_cgroup: &str, controller: &str) -> Option<String> {
    proc_self_cgroup.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let hit = if controller.is_empty() { controllers.is_empty() } else { controllers.split(',').any(|c| c == controller) };
        hit.then(|| path.trim_end_matches('/').to_string())
    })
}

fn headroom(limit: &str, usage: &str) -> Option<u64> {
    let limit: u64 = limit.trim().parse().ok()?; // "max" (no limit) fails to parse: no cap
    // cgroup v1 reports "no limit" as a huge number.
    if limit >= 1 << 62 {
        return None;
    }
    let usage: u64 = usage.trim().parse().ok()?;
    Some(limit.saturating_sub(usage))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvDtype;

    fn layout() -> KvLayout {
        KvLayout { num_layers: 2, num_kv_heads: 2, head_dim: 16, page_size: 16, dtype: KvDtype::F32 }
    }

    fn unused() -> Result<u64, SizingError> {
        panic!("memory must not be read for an explicit size")
    }

    #[test]
    fn tokens_round_up_to_whole_pages() {
        assert_eq!(PoolSize::Tokens(33).pages(&layout(), unused), Ok(3));
    }

    #[test]
    fn bytes_round_down_to_whole_pages() {
        let page = layout().page_bytes() as u64;
        assert_eq!(PoolSize::Bytes(page * 5 + page / 2).pages(&layout(), unused), Ok(5));
        assert_eq!(PoolSize::Bytes(page - 1).pages(&layout(), unused), Err(SizingError::BelowOnePage { requested: page - 1, page_bytes: page }));
    }

    #[test]
    fn finds_this_process_cgroup_per_controller() {
        let text = "9:name=systemd:/\n4:memory:/kvgate-agent-7/pod-x\n2:cpu,cpuacct:/\n0::/\n";
        assert_eq!(own_cgroup(text, "memory").as_deref(), Some("/kvgate-agent-7/pod-x"));
        assert_eq!(own_cgroup(text, "cpu").as_deref(), Some(""));
        assert_eq!(own_cgroup(text, "").as_deref(), Some(""));
        assert_eq!(own_cgroup(text, "pids"), None);
    }

    #[test]
    fn fraction_applies_to_available_memory() {
        let page = layout().page_bytes() as u64;
        assert_eq!(PoolSize::MemoryFraction(0.5).pages(&layout(), || Ok(page * 10)), Ok(5));
        assert_eq!(PoolSize::MemoryFraction(1.5).pages(&layout(), unused), Err(SizingError::BadFraction(1.5)));
        assert_eq!(PoolSize::MemoryFraction(0.0).pages(&layout(), unused), Err(SizingError::BadFraction(0.0)));
    }

    #[test]
    fn meminfo_and_cgroup_files_parse() {
        let text = "MemTotal: 100 kB\nMemAvailable:    2048 kB\n";
        assert_eq!(parse_meminfo_available(text), Some(2048 * 1024));
        assert_eq!(headroom("1000\n", "400\n"), Some(600));
        assert_eq!(headroom("max\n", "400\n"), None);
        assert_eq!(headroom("9223372036854771712", "1"), None);
    }

    #[test]
    fn this_machine_reports_some_available_memory() {
        assert!(available_host_memory().unwrap() > 0);
    }
}
