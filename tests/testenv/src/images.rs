//! The kvgate images the tests run: `scripts/images.sh --profile debug` packs the debug
//! `kvgate-worker` and `kvgate-operator` (the binaries the tests just built) into OCI image
//! layouts under `target/images-debug/`, the same way `make images` packs release binaries.
//! Rebuilt only when a binary changed (a stamp of their sizes and times), once per process, from
//! the Debian packages `make test-deps` fetched (the test world reaches no mirror).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use anyhow::Context;

pub const WORKER: &str = "ghcr.io/kvgate/kvgate-worker";
pub const OPERATOR: &str = "ghcr.io/kvgate/kvgate-operator";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The tag the layouts carry: the workspace version.
pub fn tag() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

fn stamp(bins: &[PathBuf]) -> anyhow::Result<String> {
    let mut out = String::new();
    for bin in bins {
        let m = std::fs::metadata(bin).with_context(|| format!("{} not found: build it with `cargo build --workspace` (make test does)", bin.display()))?;
        out += &format!("{} {} {:?}\n", bin.display(), m.len(), m.modified()?);
    }
    Ok(out)
}

/// Builds (or reuses) the debug images; the directory holding `oci/kvgate-worker` and
/// `oci/kvgate-operator`.
pub fn debug_layouts() -> anyhow::Result<PathBuf> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT.get_or_init(|| build().map_err(|e| format!("{e:#}"))).clone().map_err(anyhow::Error::msg)
}

fn build() -> anyhow::Result<PathBuf> {
    let root = root();
    let out = root.join("target/images-debug");
    let bins = ["kvgate-worker", "kvgate-operator"].map(|b| root.join("target/debug").join(b));
    let want = stamp(&bins)?;
    let stamp_file = out.join("stamp");
    if std::fs::read_to_string(&stamp_file).ok().as_deref() == Some(want.as_str()) {
        return Ok(out);
    }
    let status = Command::new("bash")
        .arg(root.join("scripts/images.sh"))
        .args(["--profile", "debug", "--no-archives", "--offline", "--out"])
        .arg(&out)
        .env("SOURCE_DATE_EPOCH", "0")
        .status()
        .context("running scripts/images.sh")?;
    anyhow::ensure!(
        status.success(),
        "scripts/images.sh --profile debug --offline failed ({status}); it needs umoci and the pinned packages `make test-deps` fetches"
    );
    std::fs::write(&stamp_file, want)?;
    Ok(out)
}

/// Image-table entries mapping both kvgate images to their debug layouts (`NAME=oci:DIR:TAG`).
pub fn debug_table() -> anyhow::Result<Vec<(&'static str, String)>> {
    let dir = debug_layouts()?;
    Ok([(WORKER, "kvgate-worker"), (OPERATOR, "kvgate-operator")]
        .map(|(name, image)| (name, format!("oci:{}:{}", dir.join("oci").join(image).display(), tag())))
        .to_vec())
}
