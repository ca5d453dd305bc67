//! The kvgate images the tests run: `scripts/images.sh --profile debug` packs the debug
//! `kvgate-worker` and `kvgate-operator` (the binaries the tests just built) into OCI image
//! layouts under `target/images-debug/`, the same way `make images` packs release binaries.
//! Rebuilt only when a binary changed (a stamp of their sizes and times), once per process, from
//! the Debian packages `make test-deps` fetched (the test world reaches no mirror).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use anyhow::Context;

use crate::paths::root;

pub const WORKER: &str = "ghcr.io/kvgate/kvgate-worker";
pub const OPERATOR: &str = "ghcr.io/kvgate/kvgate-operator";
/// llama.cpp's server (`llama-server` flags), the engine test image `scripts/images.sh llamacpp`
/// builds from the pinned xllamacpp wheel: a real engine for the engine-gate tests.
pub const LLAMACPP: &str = "ghcr.io/kvgate/llamacpp";

/// vLLM's CPU build, the engine test image `scripts/images.sh vllm` builds from pinned wheels
/// (several GB: `make test-vllm` builds it; the default suite does not).
pub const VLLM: &str = "ghcr.io/kvgate/vllm";

/// The image name of the vLLM test image.
pub fn vllm() -> String {
    format!("{VLLM}:{}", tag())
}

/// Whether the vLLM test image was built (`make test-vllm` builds it before its tests).
pub fn vllm_built() -> bool {
    root().join("target/images-debug/oci/vllm/index.json").is_file()
}

/// The image name of the llama.cpp test image.
pub fn llamacpp() -> String {
    format!("{LLAMACPP}:{}", tag())
}

/// Test-only worker images: the debug worker's layers under another tag whose configuration
/// switches a fault on through the environment, pushed as `WORKER-<name>`, so a test deploys a faulty revision by naming the image (`spec.image`); no CRD field can turn a
/// fault on, and release images are built without fault injection at all.
pub const FAULTY_WORKERS: &[(&str, &[(&str, &str)])] = &[
    // Prefill sends KV in a layout it does not report, from the first handoff: only comparing
    // outputs (the canary) can tell.
    ("wrong-layout", &[("KVGATE_INJECT_FAULT", "wrong-layout"), ("KVGATE_ALLOW_FAULT_INJECTION", "true")]),
    // Prefill corrupts a page of every handoff: decode refuses each (checksum), the canary fails.
    ("corrupt-page", &[("KVGATE_INJECT_FAULT", "corrupt-page"), ("KVGATE_ALLOW_FAULT_INJECTION", "true")]),
    // Prefill corrupts a page of every handoff after its 100th: passes a canary, fails under traffic.
    ("corrupt-after-100", &[("KVGATE_INJECT_FAULT", "corrupt-page"), ("KVGATE_ALLOW_FAULT_INJECTION", "true"), ("KVGATE_FAULT_AFTER", "100")]),
    // Prefill exits after its 40th handoff (past its canary) and comes back (same pod) with an eighth of its pool.
    ("restart-smaller", &[("KVGATE_FAULT_RESTART_SMALLER_AFTER", "40"), ("KVGATE_ALLOW_FAULT_INJECTION", "true")]),
];

/// The image name of a test-only faulty worker (see `FAULTY_WORKERS`). Panics at once, saying
/// how to fix it, when the debug worker cannot inject the fault (built without `testing`): its
/// pods would only crash-loop, and a test would wait for a fault that never comes.
pub fn faulty_worker(name: &str) -> String {
    assert!(FAULTY_WORKERS.iter().any(|(n, _)| *n == name), "no faulty worker image {name} in FAULTY_WORKERS");
    static CAN_INJECT: OnceLock<Result<(), String>> = OnceLock::new();
    if let Err(why) = CAN_INJECT.get_or_init(|| can_inject(&root().join("target/debug/kvgate-worker"))) {
        panic!("{why}");
    }
    format!("{WORKER}-{name}:{}", tag())
}

/// Whether the worker binary at `bin` can inject every fault of `FAULTY_WORKERS` (read once per
/// process: the debug binary is tens of MB).
fn can_inject(bin: &Path) -> Result<(), String> {
    let bytes = std::fs::read(bin).unwrap_or_default();
    // The fault a variable names, or a fault's own variable (KVGATE_FAULT_...).
    let mut needs = FAULTY_WORKERS.iter().flat_map(|(_, env)| env.iter()).filter_map(|(k, v)| match *k {
        "KVGATE_INJECT_FAULT" => Some(*v),
        k if k.starts_with("KVGATE_FAULT_") => Some(k),
        _ => None,
    });
    match needs.find(|fault| !knows(&bytes, fault)) {
        None => Ok(()),
        Some(fault) => Err(format!(
            "{} cannot inject {fault}: it was built without the `testing` feature (`cargo build --workspace` builds it so); \
             build it with `cargo build -p kvgate-worker --features testing` (make test and make bench do)",
            bin.display()
        )),
    }
}

/// Whether a worker binary's bytes hold `fault` (a fault's name or its variable): only a
/// `testing` build parses them, so only its binary contains them.
fn knows(binary: &[u8], fault: &str) -> bool {
    binary.windows(fault.len()).any(|w| w == fault.as_bytes())
}

/// The tag the layouts carry: the workspace version.
pub fn tag() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// What the images are made of: the binaries (size and time) and the engine image's inputs.
fn stamp(bins: &[PathBuf], inputs: &[PathBuf]) -> anyhow::Result<String> {
    let mut out = String::new();
    for bin in bins {
        let m = std::fs::metadata(bin).with_context(|| format!("{} not found: build it with `cargo build --workspace` (make test does)", bin.display()))?;
        out += &format!("{} {} {:?}\n", bin.display(), m.len(), m.modified()?);
    }
    for input in inputs {
        out += &format!("{}\n{}\n", input.display(), std::fs::read_to_string(input).with_context(|| format!("reading {}", input.display()))?);
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
    let inputs = ["images/python.lock", "images/llamacpp/requirements.txt", "images/llamacpp/llama-server"].map(|f| root.join(f));
    // The faulty images are tags made from the table: a changed table is a rebuild too.
    let want = format!("{}{FAULTY_WORKERS:?}\n", stamp(&bins, &inputs)?);
    let stamp_file = out.join("stamp");
    if std::fs::read_to_string(&stamp_file).ok().as_deref() == Some(want.as_str()) {
        return Ok(out);
    }
    let status = Command::new("bash")
        .arg(root.join("scripts/images.sh"))
        .args(["--profile", "debug", "--no-archives", "--offline", "--out"])
        .arg(&out)
        .args(["kvgate-worker", "kvgate-operator", "llamacpp"])
        .env("SOURCE_DATE_EPOCH", "0")
        .status()
        .context("running scripts/images.sh")?;
    anyhow::ensure!(
        status.success(),
        "scripts/images.sh --profile debug --offline failed ({status}); it needs umoci and the pinned packages `make test-deps` fetches"
    );
    let layout = out.join("oci/kvgate-worker");
    for (name, env) in FAULTY_WORKERS {
        let mut umoci = Command::new("umoci");
        umoci.args(["config", "--image"]).arg(format!("{}:{}", layout.display(), tag())).args(["--no-history", "--tag", &format!("{}-{name}", tag())]);
        for (k, v) in *env {
            umoci.arg(format!("--config.env={k}={v}"));
        }
        let status = umoci.status().context("running umoci config")?;
        anyhow::ensure!(status.success(), "umoci config for the test image {WORKER}-{name} failed ({status})");
    }
    std::fs::write(&stamp_file, want)?;
    Ok(out)
}

/// Makes the test world's images available to its nodes, as a cluster's images are: kvgate's
/// debug images, the test-only faulty workers and the llama.cpp image are pushed to the world's
/// registry (`registry`; once per process, only what changed is sent), which node agents pull
/// from as the mirror of `ghcr.io`. Returns the node agents' table of pre-loaded images: the vLLM
/// image when it was built (6.5 GB: on the node already, as `kind load` leaves an image, rather
/// than sent through the registry every run).
pub fn node_images() -> anyhow::Result<Vec<(String, String)>> {
    static PUSHED: OnceLock<Result<(), String>> = OnceLock::new();
    let dir = debug_layouts()?;
    PUSHED.get_or_init(|| push(&dir).map_err(|e| format!("{e:#}"))).clone().map_err(anyhow::Error::msg)?;
    let mut table = Vec::new();
    if vllm_built() {
        table.push((VLLM.to_string(), format!("oci:{}:{}", dir.join("oci/vllm").display(), tag())));
    }
    Ok(table)
}

fn push(dir: &Path) -> anyhow::Result<()> {
    let registry = crate::registry::shared()?;
    registry.push(dir, &["kvgate-worker", "kvgate-operator", "llamacpp"])?;
    let worker = dir.join("oci/kvgate-worker");
    for (name, _) in FAULTY_WORKERS {
        registry.push_tag(&worker, &format!("{}-{name}", tag()), &format!("kvgate-worker-{name}"), tag())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_without_the_faults_is_told_apart() {
        let dir = std::env::temp_dir().join(format!("kvgate-knows-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (testing, release) = (dir.join("testing"), dir.join("release"));
        let every: String = FAULTY_WORKERS.iter().flat_map(|(_, env)| env.iter()).map(|(k, v)| format!("{k}\0{v}\0")).collect();
        std::fs::write(&testing, format!("\x7fELF...{every}")).unwrap();
        std::fs::write(&release, b"\x7fELF...KVGATE_INJECT_FAULT\0").unwrap();
        assert_eq!(can_inject(&testing), Ok(()));
        let why = can_inject(&release).unwrap_err();
        assert!(why.contains("cannot inject wrong-layout") && why.contains("--features testing"), "{why}");
        assert!(can_inject(&dir.join("missing")).is_err());
        assert!(knows(b"..corrupt-page..", "corrupt-page") && !knows(b"..corrupt..", "corrupt-page"));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
