//! Where the repository and its build outputs are, for every module that reads them.

use std::path::{Path, PathBuf};

/// The repository's root (the workspace this crate is part of).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `target/<rel>` of the repository.
pub fn target(rel: &str) -> PathBuf {
    root().join("target").join(rel)
}
