//! Every `kubectl get infd` table shown in the README and docs/ has the CRD's columns, in its
//! order: a column renamed, added or dropped in `operator/src/crd.rs` fails here until the docs
//! follow (the README once showed columns the CRD never had).

use std::path::Path;

#[test]
fn every_table_of_inference_deployments_in_the_docs_has_the_crds_columns() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let (default, wide) = kvgate_operator::crdgen::printer_columns();
    let mut pages = vec![root.join("README.md")];
    pages.extend(std::fs::read_dir(root.join("docs")).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "md")));
    let mut tables = 0;
    let mut wrong = Vec::new();
    for page in &pages {
        for line in std::fs::read_to_string(page).unwrap().lines() {
            let words: Vec<String> = line.split_whitespace().map(str::to_string).collect();
            let header = if words.first().is_some_and(|w| w == "NAMESPACE") { &words[1..] } else { &words[..] };
            if header.first().is_some_and(|w| w == "NAME") && header.iter().any(|w| w == "ENGINE") {
                tables += 1;
                if header != default.as_slice() && header != wide.as_slice() {
                    wrong.push(format!("{}: {line}", page.strip_prefix(root).unwrap().display()));
                }
            }
        }
    }
    assert!(tables >= 2, "no `kubectl get infd` tables found in the README and docs/");
    assert!(wrong.is_empty(), "tables whose columns are not the CRD's {default:?} (or -o wide {wide:?}):\n{}", wrong.join("\n"));
}
