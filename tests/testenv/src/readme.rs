//! The documentation's shell blocks, for tests that replay a walk-through as written.

/// The `sh` blocks of the section of `page` (a path from the repository's root, e.g.
/// `docs/worker.md`) that starts with `heading`, as written.
pub fn blocks(page: &str, heading: &str) -> Vec<String> {
    let path = format!("{}/../../{page}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let start = text.find(heading).unwrap_or_else(|| panic!("{page} has no {heading:?}"));
    let section = &text[start + heading.len()..];
    let section = &section[..section.find("\n#").unwrap_or(section.len())];
    section.split("```sh\n").skip(1).map(|b| b[..b.find("```").unwrap()].to_string()).collect()
}
