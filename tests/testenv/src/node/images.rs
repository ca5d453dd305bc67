//! The node agent's "registry": an explicit table from image names to local binaries.

use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(Debug, Clone, Default)]
pub struct ImageTable(BTreeMap<String, PathBuf>);

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
    /// Parses `NAME=PATH` entries; NAME is matched with or without its tag.
    pub fn parse(entries: &[String]) -> anyhow::Result<Self> {
        let mut map = BTreeMap::new();
        for e in entries {
            let (name, path) = e.split_once('=').ok_or_else(|| anyhow::anyhow!("--image wants NAME=PATH, got `{e}`"))?;
            map.insert(name.to_string(), PathBuf::from(path));
        }
        Ok(ImageTable(map))
    }

    pub fn resolve(&self, image: &str) -> Result<PathBuf, String> {
        self.0
            .get(image)
            .or_else(|| self.0.get(repository(image)))
            .cloned()
            .ok_or_else(|| format!("image {image} is not in the node agent's image table (known: {})", self.0.keys().cloned().collect::<Vec<_>>().join(", ")))
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
        assert_eq!(t.resolve("kvgate/worker:9").unwrap(), PathBuf::from("/bin/true"));
        assert!(t.resolve("nginx:1").unwrap_err().contains("kvgate/worker"));
    }
}
