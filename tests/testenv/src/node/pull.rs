//! Pulling an image by reference, as a kubelet asks its container runtime to: the reference names
//! its registry (`198.19.0.1:5000/kvgate/kvgate-worker:0.1.0`; a name without a host is Docker
//! Hub's), and, as the container's `imagePullPolicy` asks, the manifest and the blobs it lacks
//! are fetched by `skopeo copy` into the node's own OCI image layout, and a failure is the runtime's error, which the pod reports as
//! `ErrImagePull` and then `ImagePullBackOff`. As containerd's `hosts.toml` allows, a registry
//! may have a mirror (its repositories fetched from another host, paths unchanged), and
//! registries listed as insecure are reached over plain HTTP.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

/// The node's pulled images: one OCI layout (blobs shared between images), the registries it
/// may reach without TLS, and the mirrors of registries (`ghcr.io` -> `198.19.0.1:5000`).
#[derive(Debug, Clone)]
pub struct Puller {
    layout: PathBuf,
    insecure: BTreeSet<String>,
    mirrors: BTreeMap<String, String>,
}

/// An image the node holds: the layout and the name it has there.
#[derive(Debug, Clone, PartialEq)]
pub struct Pulled {
    pub layout: PathBuf,
    pub tag: String,
}

/// The registry host of `reference` (Docker's rule: a first component with a dot, a colon or
/// `localhost` is a host; anything else is a Docker Hub repository).
pub fn registry(reference: &str) -> &str {
    match reference.split_once('/') {
        Some((first, _)) if first.contains('.') || first.contains(':') || first == "localhost" => first,
        _ => "docker.io",
    }
}

/// `reference` with `:latest` when it names neither a tag nor a digest, as the kubelet reads it.
pub fn with_default_tag(reference: &str) -> String {
    let name = reference.split('@').next().unwrap_or(reference);
    let last = name.rsplit('/').next().unwrap_or(name);
    if reference.contains('@') || last.contains(':') { reference.to_string() } else { format!("{reference}:latest") }
}

/// The name an image has in the node's layout: the reference with every character an OCI
/// layout's ref name may not hold replaced.
fn layout_name(reference: &str) -> String {
    reference.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') { c } else { '_' }).collect()
}

/// skopeo's own words from its log line (`level=fatal msg="..."`), or its stderr as it is.
fn skopeo_error(stderr: &str) -> String {
    let line = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or(stderr).trim();
    match line.split_once("msg=\"") {
        Some((_, msg)) => msg.strip_suffix('"').unwrap_or(msg).replace("\\\"", "\""),
        None => line.to_string(),
    }
}

impl Puller {
    /// A puller keeping its images in `layout` (made on first pull), reaching the registries
    /// `insecure` (`host:port`) over HTTP, and `REGISTRY=MIRROR` entries' registries at their
    /// mirror.
    pub fn new(layout: PathBuf, insecure: impl IntoIterator<Item = String>, mirrors: &[String]) -> Result<Self, String> {
        let mirrors = mirrors
            .iter()
            .map(|m| {
                m.split_once('=').map(|(r, to)| (r.to_string(), to.to_string())).ok_or_else(|| format!("--registry-mirror wants REGISTRY=MIRROR, got `{m}`"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Puller { layout, insecure: insecure.into_iter().collect(), mirrors })
    }

    /// Where `reference` is fetched from: its registry, or that registry's mirror.
    pub fn source(&self, reference: &str) -> String {
        let host = registry(reference);
        let Some(mirror) = self.mirrors.get(host) else { return reference.to_string() };
        let path = match reference.strip_prefix(host).and_then(|r| r.strip_prefix('/')) {
            Some(path) => path.to_string(),
            // A Docker Hub name without its host: `nginx` is `library/nginx`.
            None if reference.contains('/') => reference.to_string(),
            None => format!("library/{reference}"),
        };
        format!("{mirror}/{path}")
    }

    /// The image `reference` names, by the container's `imagePullPolicy` as the kubelet reads
    /// it: `Always` fetches its manifest every time (a tag may have moved) and the blobs the
    /// layout lacks, `IfNotPresent` only when the node does not hold it yet, `Never` never
    /// (`ErrImageNeverPull` when absent). The error is (waiting reason, what the kubelet says).
    pub fn image(&self, reference: &str, policy: &str) -> Result<Pulled, (&'static str, String)> {
        let named = with_default_tag(reference);
        let held = Pulled { layout: self.layout.clone(), tag: layout_name(&named) };
        let present = self.holds(&held.tag);
        match policy {
            "Never" if present => Ok(held),
            "Never" => Err(("ErrImageNeverPull", format!("Container image \"{reference}\" is not present with pull policy of Never"))),
            "IfNotPresent" if present => Ok(held),
            _ => self.pull(reference).map_err(|e| ("ErrImagePull", format!("Failed to pull image \"{reference}\": {e}"))),
        }
    }

    /// Whether the node's layout holds `tag` (a pulled image's name there).
    fn holds(&self, tag: &str) -> bool {
        let Ok(text) = std::fs::read(self.layout.join("index.json")) else { return false };
        let index: serde_json::Value = serde_json::from_slice(&text).unwrap_or_default();
        index["manifests"].as_array().into_iter().flatten().any(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag)
    }

    /// Fetches `reference` from its registry: its manifest, and only the blobs the layout lacks.
    pub fn pull(&self, reference: &str) -> Result<Pulled, String> {
        let reference = with_default_tag(reference);
        let tag = layout_name(&reference);
        let source = self.source(&reference);
        std::fs::create_dir_all(&self.layout).map_err(|e| format!("{}: {e}", self.layout.display()))?;
        let mut cmd = Command::new("skopeo");
        // The policy is the node's, not the host's /etc/containers (which may not exist).
        cmd.args(["copy", "--insecure-policy", "--quiet"]);
        if self.insecure.contains(registry(&source)) {
            cmd.arg("--src-tls-verify=false");
        }
        cmd.arg(format!("docker://{source}")).arg(format!("oci:{}:{tag}", self.layout.display()));
        let out = cmd.output().map_err(|e| format!("skopeo: {e} (install it: apt-get install skopeo, or make test-deps)"))?;
        if !out.status.success() {
            return Err(skopeo_error(&String::from_utf8_lossy(&out.stderr)));
        }
        Ok(Pulled { layout: self.layout.clone(), tag })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_name_their_registry_and_tag_as_the_kubelet_reads_them() {
        assert_eq!(registry("198.19.0.1:5000/kvgate/kvgate-worker:0.1.0"), "198.19.0.1:5000");
        assert_eq!(registry("ghcr.io/kvgate/kvgate-worker"), "ghcr.io");
        assert_eq!(registry("localhost/w"), "localhost");
        assert_eq!(registry("library/nginx:1"), "docker.io");
        assert_eq!(registry("nginx"), "docker.io");
        assert_eq!(with_default_tag("198.19.0.1:5000/w"), "198.19.0.1:5000/w:latest");
        assert_eq!(with_default_tag("198.19.0.1:5000/w:1"), "198.19.0.1:5000/w:1");
        assert_eq!(with_default_tag("w@sha256:ab"), "w@sha256:ab");
        assert_eq!(layout_name("198.19.0.1:5000/kvgate/w:0.1.0"), "198.19.0.1_5000_kvgate_w_0.1.0");
    }

    #[test]
    fn a_mirrored_registry_is_fetched_from_its_mirror_with_the_same_path() {
        let p = Puller::new("/tmp/x".into(), ["198.19.0.1:5000".to_string()], &["ghcr.io=198.19.0.1:5000".into(), "docker.io=m:1".into()]).unwrap();
        assert_eq!(p.source("ghcr.io/kvgate/kvgate-worker:0.1.0"), "198.19.0.1:5000/kvgate/kvgate-worker:0.1.0");
        assert_eq!(p.source("quay.io/x/y:1"), "quay.io/x/y:1");
        assert_eq!(p.source("nginx:1"), "m:1/library/nginx:1");
        assert_eq!(p.source("bitnami/redis:7"), "m:1/bitnami/redis:7");
        assert!(Puller::new("/tmp/x".into(), [], &["ghcr.io".into()]).unwrap_err().contains("REGISTRY=MIRROR"));
    }

    #[test]
    fn the_pull_policy_decides_whether_the_registry_is_asked() {
        let dir = std::env::temp_dir().join(format!("kvgate-pull-policy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let held = layout_name("198.19.0.1:5000/kvgate/w:1");
        let index = serde_json::json!({ "manifests": [{ "annotations": { "org.opencontainers.image.ref.name": held } }] });
        std::fs::write(dir.join("index.json"), index.to_string()).unwrap();
        // No registry answers at this address: only a pull would fail.
        let p = Puller::new(dir.clone(), [], &[]).unwrap();
        for policy in ["IfNotPresent", "Never"] {
            assert_eq!(p.image("198.19.0.1:5000/kvgate/w:1", policy).unwrap().tag, held, "{policy}");
        }
        let (reason, message) = p.image("198.19.0.1:5000/kvgate/w:2", "Never").unwrap_err();
        assert_eq!(
            (reason, message.as_str()),
            ("ErrImageNeverPull", "Container image \"198.19.0.1:5000/kvgate/w:2\" is not present with pull policy of Never")
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_failed_pull_says_what_skopeo_said() {
        let stderr = "time=\"2026-12-07T15:00:00Z\" level=fatal msg=\"initializing source docker://198.19.0.1:5000/kvgate/nope:1: reading manifest 1 in 198.19.0.1:5000/kvgate/nope: manifest unknown\"\n";
        assert_eq!(
            skopeo_error(stderr),
            "initializing source docker://198.19.0.1:5000/kvgate/nope:1: reading manifest 1 in 198.19.0.1:5000/kvgate/nope: manifest unknown"
        );
        assert_eq!(skopeo_error("plain words\n"), "plain words");
    }
}
