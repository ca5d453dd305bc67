//! The map stays true: every repository path that `docs/architecture.md` (with its "Where
//! things are" table) names exists.

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
    assert!(architecture.contains("\n## Where things are\n"), "docs/architecture.md has no \"Where things are\"");
    let named = named_paths(&architecture);
    assert!(named.len() >= 40, "the maps name {} paths: {named:?}", named.len());
    let missing: Vec<&String> = named.iter().filter(|p| !root().join(p).exists()).collect();
    assert!(missing.is_empty(), "named but not in the repository: {missing:?}");
}

/// The README stays a page a newcomer reads once (issue 63: at most 2,500 words; the rest lives
/// in docs/), and every relative link of the README and docs/ leads to a file that exists.
#[test]
fn the_readme_stays_short_and_every_relative_link_resolves() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let words = readme.split_whitespace().count();
    assert!(words <= 2500, "README.md has {words} words, over 2,500: move detail to a page under docs/");
    let mut pages = vec![root().join("README.md")];
    pages.extend(std::fs::read_dir(root().join("docs")).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "md")));
    let mut broken = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for link in text.split("](").skip(1).filter_map(|s| s.split(')').next()) {
            let target = link.split('#').next().unwrap();
            if target.is_empty() || target.contains("://") {
                continue;
            }
            if !page.parent().unwrap().join(target).exists() {
                broken.push(format!("{}: {link}", page.strip_prefix(root()).unwrap().display()));
            }
        }
    }
    assert!(pages.len() >= 10, "docs/ pages not found: {pages:?}");
    assert!(broken.is_empty(), "links to files that do not exist: {broken:?}");
}
