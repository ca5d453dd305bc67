//! The results docs/benchmarks.md is generated from (`bench/results/*.json`) hold only rows
//! that the benchmarks print: every row label there must match a label template in the
//! benchmarks' sources (a string literal of `worker/benches/`, `operator/benches/`, `bench/*.py`
//! or `engines/vllm/bench/`, its `{...}` placeholders matching anything). A row renamed or
//! dropped in the code fails here until the bench is run again.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The string literals of one source file (Rust `"..."`, Python `'...'` and `"..."`).
fn literals(text: &str, python: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '/' && !python && chars.peek() == Some(&'/') || c == '#' && python {
            // A comment: to the end of the line.
            for c in chars.by_ref() {
                if c == '\n' {
                    break;
                }
            }
            continue;
        }
        let quote = match c {
            '"' => '"',
            '\'' if python => '\'',
            _ => continue,
        };
        let mut s = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => {
                    if let Some(next) = chars.next() {
                        s.push(next);
                    }
                }
                c if c == quote => break,
                c => s.push(c),
            }
        }
        out.push(s);
    }
    out
}

/// A label as a sequence of literal pieces between placeholders (`{...}`).
struct Template(Vec<String>);

impl Template {
    fn parse(s: &str) -> Template {
        let mut pieces = vec![String::new()];
        let mut depth = 0;
        for c in s.chars() {
            match c {
                '{' => {
                    depth += 1;
                    if depth == 1 {
                        pieces.push(String::new());
                    }
                }
                '}' if depth > 0 => depth -= 1,
                _ if depth > 0 => {}
                c => pieces.last_mut().unwrap().push(c),
            }
        }
        Template(pieces.into_iter().map(|p| normalize(&p)).collect())
    }

    /// Whether it can name a row: an exact label, or one with placeholders that fixes enough
    /// letters not to match anything.
    fn names_a_row(&self) -> bool {
        let letters = self.0.iter().flat_map(|p| p.chars()).filter(char::is_ascii_alphabetic).count();
        if self.0.len() == 1 { letters >= 1 && self.0[0].len() >= 3 } else { letters >= 8 }
    }

    fn matches(&self, cell: &str) -> bool {
        let (first, rest) = self.0.split_first().unwrap();
        let Some(mut left) = cell.strip_prefix(first.as_str()) else { return false };
        for (i, piece) in rest.iter().enumerate() {
            let last = i + 1 == rest.len();
            if last {
                return piece.is_empty() || (left.len() > piece.len() && left.ends_with(piece.as_str()));
            }
            match left.get(1..).and_then(|l| l.find(piece.as_str())) {
                Some(at) => left = &left[1 + at + piece.len()..],
                None => return false,
            }
        }
        left.is_empty()
    }
}

/// A literal that prints a whole table row (`"| label | {} | ... |"`) names its first cell; any
/// other is a label itself.
fn first_cell(literal: &str) -> String {
    let Some(row) = literal.trim_start().strip_prefix('|') else { return literal.to_string() };
    // The first `|` outside a placeholder ends the cell.
    let mut depth = 0;
    for (i, c) in row.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            '|' if depth == 0 => return row[..i].to_string(),
            _ => {}
        }
    }
    row.to_string()
}

/// Markdown and spacing aside: what the bench prints and the page shows.
fn normalize(s: &str) -> String {
    s.replace('`', "").split_whitespace().collect::<Vec<_>>().join(" ")
}

fn templates() -> Vec<Template> {
    let mut files = Vec::new();
    for dir in ["worker/benches", "worker/benches/common", "operator/benches", "bench", "engines/vllm/bench"] {
        for entry in std::fs::read_dir(root().join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "rs" || e == "py") {
                files.push(path);
            }
        }
    }
    assert!(files.len() >= 8, "the benchmarks' sources moved: {files:?}");
    files
        .iter()
        .flat_map(|f| literals(&std::fs::read_to_string(f).unwrap(), f.extension().is_some_and(|e| e == "py")))
        .map(|s| Template::parse(&first_cell(&s)))
        .filter(Template::names_a_row)
        .collect()
}

/// The first cell of every row of every kept result, but rows whose label is a number (a level
/// of a load curve, a prompt length, under a header the bench prints).
fn labels() -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(root().join("bench/results")).unwrap() {
        let path = entry.unwrap().path();
        let results: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for table in results["tables"].as_array().unwrap() {
            for row in table["rows"].as_array().unwrap() {
                let first = normalize(row[0].as_str().unwrap());
                if first.chars().any(|c| c.is_ascii_alphabetic()) {
                    out.push(first);
                }
            }
        }
    }
    out
}

#[test]
fn every_kept_benchmark_row_is_one_make_bench_prints() {
    let templates = templates();
    let labels = labels();
    assert!(labels.len() >= 40, "bench/results/'s tables were not found: {labels:?}");
    let orphans: Vec<&String> = labels.iter().filter(|l| !templates.iter().any(|t| t.matches(l))).collect();
    assert!(orphans.is_empty(), "bench/results/ rows no benchmark prints (run the benchmark again: `make bench`):\n{orphans:#?}");
}

#[test]
fn a_template_matches_its_own_rows_and_no_other() {
    let t = Template::parse("tiny decode, batch {batch}, context 512");
    assert!(t.matches("tiny decode, batch 8, context 512"));
    assert!(!t.matches("tiny decode, batch 8, context 1024"));
    assert!(!t.matches("tiny prefill, batch 8, context 512"));
    let t = Template::parse("{n}-token handoff, median");
    assert!(t.matches("8192-token handoff, median"));
    assert!(!t.matches("8192-token handoff, p99"));
    assert_eq!(literals(r#"row("a \"b\"", x) // "c""#, false), ["a \"b\""]);
    assert_eq!(literals("f'{n} rows' # 'x'", true), ["{n} rows"]);
    assert_eq!(first_cell("| handoff time, {pages} pages | {:.1} ms |"), " handoff time, {pages} pages ");
}
