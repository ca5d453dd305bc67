//! The maps stay true: every repository path that `docs/architecture.md` and the README's
//! "Where things are" table name exists.

use std::path::Path;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

/// Backticked paths under the crates' directories, e.g. `operator/src/gate.rs`.
fn named_paths(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|p| ["operator/", "worker/", "proto/", "telemetry/", "xtask/", "docs/"].iter().any(|r| p.starts_with(r)))
        .filter(|p| !p.contains(' '))
        .map(str::to_string)
        .collect()
}

#[test]
fn every_path_the_maps_name_exists() {
    let architecture = std::fs::read_to_string(root().join("docs/architecture.md")).unwrap();
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let table = readme.split("## Where things are").nth(1).and_then(|s| s.split("\n## ").next()).expect("README has \"Where things are\"");
    let mut named = named_paths(&architecture);
    named.extend(named_paths(table));
    assert!(named.len() >= 40, "the maps name {} paths: {named:?}", named.len());
    let missing: Vec<&String> = named.iter().filter(|p| !root().join(p).exists()).collect();
    assert!(missing.is_empty(), "named but not in the repository: {missing:?}");
}
