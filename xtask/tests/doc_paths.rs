//! The docs stay true to the repository: every path `docs/architecture.md` (with its "Where
//! things are" table) names exists, and it names every top-level module of every crate; the README stays short and every relative link of the docs
//! leads somewhere; and every `kubectl get infd` table they show has the CRD's columns.

use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

/// The README and every page under docs/.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    pages.extend(std::fs::read_dir(root().join("docs")).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "md")));
    pages
}

/// Backticked paths under the crates' directories, e.g. `operator/src/gate.rs`.
fn named_paths(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|p| ["operator/", "worker/", "proto/", "telemetry/", "heap/", "tests/", "engines/", "xtask/", "docs/"].iter().any(|r| p.starts_with(r)))
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

/// Every crate's source directory: the architecture page names each module in it.
const CRATES: [&str; 7] = ["operator/src", "worker/src", "proto/src", "telemetry/src", "heap/src", "tests/testenv/src", "xtask/src"];

/// The top-level modules of a crate, as the page may name them: `dir/name.rs` for a file,
/// `dir/name/` for a directory (a module with both is named by either).
fn modules(dir: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(root().join(dir))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|name| name != "lib.rs" && name != "main.rs")
        .filter_map(|name| match name.strip_suffix(".rs") {
            Some(stem) => Some((format!("{dir}/{name}"), format!("{dir}/{stem}/"))),
            None if root().join(dir).join(&name).is_dir() => Some((format!("{dir}/{name}/"), format!("{dir}/{name}.rs"))),
            None => None,
        })
        .collect();
    out.sort();
    out
}

#[test]
fn the_architecture_page_names_every_module_of_every_crate() {
    let architecture = std::fs::read_to_string(root().join("docs/architecture.md")).unwrap();
    let named = named_paths(&architecture);
    let mut missing = Vec::new();
    for dir in CRATES {
        let modules = modules(dir);
        assert!(modules.len() >= 2, "{dir} has no modules: the crates moved");
        // A directory is named by itself or by any path inside it.
        let is_named = |p: &String| named.iter().any(|n| n == p || (p.ends_with('/') && n.starts_with(p.as_str())));
        missing.extend(modules.into_iter().filter(|(a, b)| !is_named(a) && !is_named(b)).map(|(a, _)| a));
    }
    assert!(missing.is_empty(), "docs/architecture.md does not name these modules (one line each, in their crate's table): {missing:#?}");
}

/// The README stays a page a newcomer reads once (issue 63: at most 2,500 words; the rest lives
/// in docs/), and every relative link of the README and docs/ leads to a file that exists.
#[test]
fn the_readme_stays_short_and_every_relative_link_resolves() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let words = readme.split_whitespace().count();
    assert!(words <= 2500, "README.md has {words} words, over 2,500: move detail to a page under docs/");
    let pages = pages();
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

/// A column renamed, added or dropped in `operator/src/crd.rs` fails here until the docs follow
/// (the README once showed columns the CRD never had): each table is the default view or `-o wide`.
#[test]
fn every_table_of_inference_deployments_in_the_docs_has_the_crds_columns() {
    let (default, wide) = kvgate_operator::crdgen::printer_columns();
    let mut tables = 0;
    let mut wrong = Vec::new();
    for page in &pages() {
        for line in std::fs::read_to_string(page).unwrap().lines() {
            let words: Vec<String> = line.split_whitespace().map(str::to_string).collect();
            let header = if words.first().is_some_and(|w| w == "NAMESPACE") { &words[1..] } else { &words[..] };
            if header.first().is_some_and(|w| w == "NAME") && header.iter().any(|w| w == "ENGINE") {
                tables += 1;
                if header != default.as_slice() && header != wide.as_slice() {
                    wrong.push(format!("{}: {line}", page.strip_prefix(root()).unwrap().display()));
                }
            }
        }
    }
    assert!(tables >= 2, "no `kubectl get infd` tables found in the README and docs/");
    assert!(wrong.is_empty(), "tables whose columns are not the CRD's {default:?} (or -o wide {wide:?}):\n{}", wrong.join("\n"));
}
