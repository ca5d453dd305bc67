//! The node's pre-loaded images: a table from image names to OCI image layouts already on the
//! node (as `kind load` or a node image leaves them; run as OCI containers by runc, see `runc`)
//! or, for tools of the agent's own tests that have no image (python3, kubectl), host binaries
//! run as processes in the pod's namespaces. Any other image is pulled from its registry
//! (`pull`), as a kubelet's runtime pulls one it does not hold.

use std::collections::BTreeMap;
use std::path::PathBuf;

/// What an image name maps to.
#[derive(Debug, Clone, PartialEq)]
pub enum Image {
    /// An OCI image layout (as `make images` writes it) and the tag to run.
    Oci { layout: PathBuf, tag: String },
    /// A binary on the host, run as a process (no root filesystem of its own).
    Host(PathBuf),
    /// Not on the node: pulled from the registry its reference names.
    Pull(String),
}

#[derive(Debug, Clone, Default)]
pub struct ImageTable(BTreeMap<String, Image>);

/// `registry/repo:tag` or `repo@sha256:...` without the tag or digest.
pub fn repository(image: &str) -> &str {
    let image = image.split('@').next().unwrap_or(image);
    match image.rfind(':') {
        // A colon after the last slash separates the tag; one before it is a registry port.
        Some(i) if !image[i..].contains('/') => &image[..i],
        _ => image,
    }
}

impl ImageTable {
    /// Parses `NAME=oci:LAYOUT:TAG` (an OCI image layout) and `NAME=PATH` (a host binary)
    /// entries; NAME is matched with or without its tag.
    pub fn parse(entries: &[String]) -> anyhow::Result<Self> {
        let mut map = BTreeMap::new();
        for e in entries {
            let (name, value) = e.split_once('=').ok_or_else(|| anyhow::anyhow!("--image wants NAME=oci:LAYOUT:TAG or NAME=PATH, got `{e}`"))?;
            let image = match value.strip_prefix("oci:") {
                Some(oci) => {
                    let (layout, tag) = oci.rsplit_once(':').ok_or_else(|| anyhow::anyhow!("--image {name}: `{value}` names no tag (oci:LAYOUT:TAG)"))?;
                    let layout = PathBuf::from(layout);
                    anyhow::ensure!(
                        layout.join("index.json").is_file(),
                        "--image {name}: {} is not an OCI image layout (no index.json); build it with `make images`",
                        layout.display()
                    );
                    Image::Oci { layout, tag: tag.to_string() }
                }
                None => Image::Host(PathBuf::from(value)),
            };
            map.insert(name.to_string(), image);
        }
        Ok(ImageTable(map))
    }

    /// The pre-loaded image `image` names, or the reference to pull.
    pub fn resolve(&self, image: &str) -> Image {
        self.0.get(image).or_else(|| self.0.get(repository(image))).cloned().unwrap_or_else(|| Image::Pull(image.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_digests_and_registry_ports_are_handled() {
        assert_eq!(repository("ghcr.io/kvgate/worker:0.1.0"), "ghcr.io/kvgate/worker");
        assert_eq!(repository("localhost:5000/worker"), "localhost:5000/worker");
        assert_eq!(repository("worker@sha256:abc"), "worker");
        let t = ImageTable::parse(&["kvgate/worker=/bin/true".into()]).unwrap();
        assert_eq!(t.resolve("kvgate/worker:9"), Image::Host(PathBuf::from("/bin/true")));
        assert_eq!(t.resolve("nginx:1"), Image::Pull("nginx:1".into()));
    }

    #[test]
    fn oci_entries_name_a_layout_and_a_tag() {
        let dir = std::env::temp_dir().join(format!("kvgate-images-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("index.json"), "{}").unwrap();
        let t = ImageTable::parse(&[format!("kvgate/worker=oci:{}:0.1.0", dir.display())]).unwrap();
        assert_eq!(t.resolve("kvgate/worker:test"), Image::Oci { layout: dir.clone(), tag: "0.1.0".into() });
        assert!(ImageTable::parse(&[format!("w=oci:{}", dir.display())]).unwrap_err().to_string().contains("names no tag"));
        assert!(ImageTable::parse(&["w=oci:/nonexistent:1".into()]).unwrap_err().to_string().contains("make images"));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
