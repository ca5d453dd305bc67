//! Imports run one way: within each module, its child modules form no circle.
//!
//! For every directory of a crate's `src` (the crate root, `reconcile/`, `reconcile/decide/`,
//! ...), the children are its files and subdirectories. Child A depends on child B when any
//! non-test code under A names a path under B (`use crate::b::..`, `super::b::..`, inline
//! `crate::b::x(..)`). A child naming its parent's own items (`super::Context`) is not an edge:
//! a parent gathers its children. Test code (`tests.rs`, `#[cfg(test)] mod` blocks) is left out.
//! A circle among siblings fails the test, naming each edge and a line that makes it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const CRATES: [&str; 5] = ["operator/src", "worker/src", "proto/src", "telemetry/src", "tests/testenv/src"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A file's module path: `reconcile/decide/mod.rs` -> [reconcile, decide]; `lib.rs` -> [].
fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_string());
    }
    parts
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of a file without comments, string contents and test modules.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod ") {
        Some(i) => &text[..i],
        None => text,
    };
    let mut out = String::new();
    for line in text.lines() {
        let line = line.split("//").next().unwrap_or("");
        let mut in_str = false;
        for c in line.chars() {
            if c == '"' {
                in_str = !in_str;
                out.push(c);
            } else if !in_str {
                out.push(c);
            }
        }
        out.push('\n');
    }
    out
}

/// Every path a use tree names: `crate::{a, b::{c, d}}` -> crate::a, crate::b::c, crate::b::d.
fn expand(tree: &str) -> Vec<String> {
    let tree: String = tree.chars().filter(|c| !c.is_whitespace()).collect();
    let Some(open) = tree.find('{') else { return vec![tree] };
    let close = tree.rfind('}').unwrap_or(tree.len());
    let prefix = &tree[..open];
    let inner = &tree[open + 1..close];
    let (mut depth, mut start, mut parts) = (0, 0, Vec::new());
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.is_empty())
        .flat_map(expand)
        .map(|p| if p == "self" { prefix.trim_end_matches("::").to_string() } else { format!("{prefix}{p}") })
        .collect()
}

/// The paths a file's code names, as written (`crate::..`, `super::..`, `self::..`, or a child
/// module's name): from `use` trees and from inline paths.
fn named_paths(code: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("use ") {
        let before_ok = i == 0 || !rest.as_bytes()[i - 1].is_ascii_alphanumeric() && rest.as_bytes()[i - 1] != b'_';
        let after = &rest[i + 4..];
        match after.find(';') {
            Some(end) if before_ok => {
                let tree = &after[..end];
                for p in expand(tree.split(" as ").next().unwrap_or(tree)) {
                    out.push((p, format!("use {}", tree.split_whitespace().collect::<Vec<_>>().join(" "))));
                }
                rest = &after[end..];
            }
            _ => rest = after,
        }
    }
    for prefix in ["crate::", "super::"] {
        let mut rest = code;
        while let Some(i) = rest.find(prefix) {
            let before_ok = i == 0 || !(rest.as_bytes()[i - 1].is_ascii_alphanumeric() || matches!(rest.as_bytes()[i - 1], b'_' | b':'));
            let tail = &rest[i..];
            let end = tail.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).unwrap_or(tail.len());
            if before_ok {
                let path = tail[..end].trim_end_matches(':').to_string();
                out.push((path.clone(), path));
            }
            rest = &rest[i + prefix.len()..];
        }
    }
    out
}

/// An absolute path (segments) for `path` named in module `at`; `None` for other crates.
fn absolute(path: &str, at: &[String], children: &BTreeSet<String>) -> Option<Vec<String>> {
    let segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
    let (mut base, mut i) = match segs.first()? {
        &"crate" => (Vec::new(), 1),
        &"self" => (at.to_vec(), 1),
        &"super" => (at.to_vec(), 0),
        first if children.contains(*first) => (at.to_vec(), 0),
        _ => return None,
    };
    while segs.get(i) == Some(&"super") {
        base.pop();
        i += 1;
    }
    base.extend(segs[i..].iter().map(|s| s.to_string()));
    Some(base)
}

#[test]
fn no_module_imports_in_a_circle() {
    let report: Vec<String> = CRATES.iter().flat_map(|krate| circles(&root().join(krate), krate)).collect();
    assert!(report.is_empty(), "modules that import each other, directly or around a circle:\n{}", report.join("\n"));
}

/// Every edge between siblings that lies on a circle, in the crate whose sources are `src`.
fn circles(src: &Path, krate: &str) -> Vec<String> {
    let mut report = Vec::new();
    let mut all = Vec::new();
    files(src, &mut all);
    let modules: BTreeSet<Vec<String>> = all.iter().map(|f| module_of(f.strip_prefix(src).unwrap())).collect();
    // The longest prefix of `path` that is a module.
    let module_prefix =
        |path: &[String]| -> Vec<String> { (0..=path.len()).rev().map(|n| path[..n].to_vec()).find(|p| modules.contains(p)).unwrap_or_default() };
    // (directory, child from, child to) -> an example.
    let mut edges: BTreeMap<(Vec<String>, String, String), BTreeSet<String>> = BTreeMap::new();
    for f in &all {
        let rel = f.strip_prefix(src).unwrap();
        if rel.file_name().is_some_and(|n| n == "tests.rs") {
            continue;
        }
        let at = module_of(rel);
        let children: BTreeSet<String> = modules.iter().filter(|m| m.len() == at.len() + 1 && m.starts_with(&at)).map(|m| m[at.len()].clone()).collect();
        let text = std::fs::read_to_string(f).unwrap();
        for (path, example) in named_paths(&code(&text)) {
            let Some(abs) = absolute(&path, &at, &children) else { continue };
            let target = module_prefix(&abs);
            // The common ancestor of the two modules: the directory whose children they are.
            let common = at.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if common == at.len() || common == target.len() {
                // An ancestor or a descendant: a parent and its children are one module.
                continue;
            }
            let key = (at[..common].to_vec(), at[common].clone(), target[common].clone());
            edges.entry(key).or_default().insert(format!("{}: {example}", rel.display()));
        }
    }
    // Circles among the children of each directory: strongly connected components.
    let dirs: BTreeSet<Vec<String>> = edges.keys().map(|(d, _, _)| d.clone()).collect();
    for dir in dirs {
        let graph: BTreeMap<&str, Vec<&str>> = edges.keys().filter(|(d, _, _)| *d == dir).fold(BTreeMap::new(), |mut g, (_, a, b)| {
            g.entry(a.as_str()).or_insert_with(Vec::new).push(b.as_str());
            g
        });
        let reach = |from: &str| -> BTreeSet<String> {
            let (mut seen, mut stack) = (BTreeSet::new(), vec![from.to_string()]);
            while let Some(n) = stack.pop() {
                for next in graph.get(n.as_str()).into_iter().flatten() {
                    if seen.insert(next.to_string()) {
                        stack.push(next.to_string());
                    }
                }
            }
            seen
        };
        for ((d, a, b), examples) in edges.iter().filter(|((d, _, _), _)| *d == dir) {
            if reach(b).contains(a) {
                let place = if d.is_empty() { krate.to_string() } else { format!("{krate}/{}", d.join("/")) };
                let examples: Vec<&str> = examples.iter().map(String::as_str).collect();
                report.push(format!("{place}: {a} -> {b} (and {b} reaches {a}):\n    {}", examples.join("\n    ")));
            }
        }
    }
    report
}

#[test]
fn a_circle_through_a_third_module_is_found_and_a_parent_is_not_one() {
    let dir = std::env::temp_dir().join(format!("kvgate-circles-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("c")).unwrap();
    let write = |f: &str, text: &str| std::fs::write(dir.join(f), text).unwrap();
    write("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n");
    write("a.rs", "use crate::b::B;\n// crate::c::C in a comment is not an edge\n");
    write("b.rs", "pub struct B;\nfn f() { crate::c::inner::g() }\n");
    write("c/mod.rs", "pub mod inner;\npub struct C;\n");
    write("c/inner.rs", "use super::C;\npub fn g() { let _ = crate::a::A; }\n");
    let found = circles(&dir, "t");
    assert_eq!(found.len(), 3, "{found:#?}");
    assert!(found[0].starts_with("t: a -> b") && found[0].contains("a.rs: use crate::b::B"), "{found:#?}");
    write("c/inner.rs", "use super::C;\n");
    assert!(circles(&dir, "t").is_empty(), "inner naming its parent's C is no circle");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn use_trees_expand_to_every_path() {
    assert_eq!(expand("crate::{a, b::{c, self}}"), ["crate::a", "crate::b::c", "crate::b"]);
    assert_eq!(absolute("super::super::x::Y", &["a".into(), "b".into()], &BTreeSet::new()), Some(vec!["x".to_string(), "Y".to_string()]));
    assert_eq!(absolute("tokio::spawn", &[], &BTreeSet::new()), None);
}
