//! OCI image layouts on the node: the manifest a tag names, the image's configuration (user,
//! entrypoint, environment, working directory), and its root filesystem, unpacked once per
//! manifest digest with `umoci` and shared read-only by every container of that image.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The parts of an image's configuration a container starts from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ImageConfig {
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub env: Vec<String>,
    pub working_dir: Option<String>,
}

/// An image ready to run: its digest (the pod's `imageID`), configuration and root filesystem.
#[derive(Debug, Clone)]
pub struct Unpacked {
    pub digest: String,
    pub config: ImageConfig,
    pub rootfs: PathBuf,
}

/// Where unpacked images are kept (one directory per manifest digest).
#[derive(Debug, Clone)]
pub struct ImageStore {
    dir: PathBuf,
}

fn read_json(path: &Path) -> Result<Value, String> {
    let text = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn blob(layout: &Path, digest: &str) -> Result<Value, String> {
    let (algorithm, hex) = digest.split_once(':').ok_or_else(|| format!("malformed digest {digest}"))?;
    if algorithm != "sha256" || hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("unsupported digest {digest}"));
    }
    read_json(&layout.join("blobs").join(algorithm).join(hex))
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().into_iter().flatten().filter_map(|s| s.as_str().map(str::to_string)).collect()
}

/// The manifest digest `tag` names in `layout`, and the image configuration it points to.
pub fn inspect(layout: &Path, tag: &str) -> Result<(String, ImageConfig), String> {
    let index = read_json(&layout.join("index.json"))?;
    let manifest = index["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag)
        .ok_or_else(|| format!("tag {tag} is not in the OCI layout {}", layout.display()))?;
    let digest = manifest["digest"].as_str().ok_or_else(|| format!("{}: manifest without a digest", layout.display()))?.to_string();
    let config_digest = blob(layout, &digest)?["config"]["digest"].as_str().map(str::to_string).ok_or_else(|| format!("manifest {digest} names no config"))?;
    let c = &blob(layout, &config_digest)?["config"];
    let config = ImageConfig {
        user: c["User"].as_str().filter(|u| !u.is_empty()).map(str::to_string),
        entrypoint: strings(&c["Entrypoint"]),
        cmd: strings(&c["Cmd"]),
        env: strings(&c["Env"]),
        working_dir: c["WorkingDir"].as_str().filter(|d| !d.is_empty()).map(str::to_string),
    };
    Ok((digest, config))
}

impl ImageStore {
    pub fn new(dir: PathBuf) -> Self {
        ImageStore { dir }
    }

    /// The image `tag` of `layout`, unpacked on first use (`umoci unpack`, which keeps the
    /// layers' owners and modes).
    pub fn unpack(&self, layout: &Path, tag: &str) -> Result<Unpacked, String> {
        let (digest, config) = inspect(layout, tag)?;
        let dir = self.dir.join(digest.replace(':', "-"));
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        // Pods of one image may start together, on this agent or another sharing the store.
        crate::once_dir::make_once(
            &dir,
            |d| d.join("rootfs").is_dir(),
            |tmp| {
                // umoci makes the bundle directory itself.
                std::fs::remove_dir(tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
                let out = Command::new("umoci")
                    .args(["unpack", "--image"])
                    .arg(format!("{}:{tag}", layout.display()))
                    .arg(tmp)
                    .output()
                    .map_err(|e| format!("umoci: {e} (install it: apt-get install umoci, or make test-deps)"))?;
                if !out.status.success() {
                    return Err(format!("umoci unpack {}:{tag}: {}", layout.display(), String::from_utf8_lossy(&out.stderr).trim()));
                }
                Ok(())
            },
        )?;
        Ok(Unpacked { digest, config, rootfs: dir.join("rootfs") })
    }
}
