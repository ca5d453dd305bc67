//! The programs `make tools` builds into `target/tools/bin/` (helm, the chart linters, Jaeger,
//! Alertmanager).

use std::path::PathBuf;

/// `target/tools/bin/<name>`, or a failure that says how to build it.
pub fn tool(name: &str) -> anyhow::Result<PathBuf> {
    let p = crate::paths::target("tools/bin").join(name);
    anyhow::ensure!(p.is_file(), "{} not found: build it with `make tools` (make test does)", p.display());
    Ok(p)
}
