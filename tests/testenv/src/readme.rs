//! The README's shell blocks, for tests that replay a walk-through as written.

/// The `sh` blocks of the README section that starts with `heading`, as written.
pub fn blocks(heading: &str) -> Vec<String> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let start = readme.find(heading).unwrap_or_else(|| panic!("README has no {heading:?}"));
    let section = &readme[start + heading.len()..];
    let section = &section[..section.find("\n#").unwrap_or(section.len())];
    section.split("```sh\n").skip(1).map(|b| b[..b.find("```").unwrap()].to_string()).collect()
}
