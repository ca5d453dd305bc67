//! Every file of the repository that is generated from another, in one place.
//!
//! `cargo xtask generate` (`make generate`) writes them all; `cargo xtask check` writes nothing
//! and fails naming each stale file (a test runs it). Generated: the CRD YAML (from
//! `operator/src/crd.rs`) in `crds/` and in the chart, the dashboards (from
//! `dashboards/generate.py`) and the alert rules in the chart, the table of handoff refusal
//! reasons in `docs/handoff-protocol.md` (from `proto/src/refusal.rs`), the values table of
//! `charts/kvgate/README.md` (from the `# --` comments of `charts/kvgate/values.yaml`), and the
//! CLI reference `docs/cli.md` (from the binaries' clap definitions), and `docs/benchmarks.md`
//! (from `bench/benchmarks.md.in` and the results `make bench` keeps in `bench/results/`).
//!
//! `cargo xtask bench NAME -- COMMAND...` runs one benchmark and keeps its results (`make bench`
//! runs every one this way).

mod bench_data;
mod bench_page;
mod bench_run;
mod cli_reference;
mod values_table;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

const DASHBOARDS: [&str; 4] = ["integrity", "capacity", "serving", "operator"];
const REASONS_DOC: &str = "docs/handoff-protocol.md";
const BEGIN: &str = "<!-- generated:refusal-reasons (cargo xtask generate; from proto/src/refusal.rs) -->\n";
const END: &str = "<!-- end:refusal-reasons -->\n";
const CODES_BEGIN: &str = "<!-- generated:error-codes (cargo xtask generate; from proto/src/codes.rs) -->\n";
const CODES_END: &str = "<!-- end:error-codes -->\n";
const CHART_README: &str = "charts/kvgate/README.md";
const VALUES_BEGIN: &str = "<!-- generated:values (cargo xtask generate; from values.yaml) -->\n";
const VALUES_END: &str = "<!-- end:values -->\n";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the repository").to_path_buf()
}

fn read(path: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(root().join(path)).with_context(|| format!("reading {path}"))
}

/// Every generated file that is written from Rust, as (path, wanted contents).
fn outputs() -> anyhow::Result<Vec<(String, String)>> {
    let crds = kvgate_operator::crdgen::yaml()?;
    let mut out = vec![(kvgate_operator::crdgen::FILE.to_string(), crds.clone()), (format!("charts/kvgate/files/{}", kvgate_operator::crdgen::FILE), crds)];
    out.push(("charts/kvgate/files/alerts.yaml".into(), read("dashboards/alerts.yaml")?));
    out.push(("charts/kvgate/files/runbooks.md".into(), read("docs/runbooks.md")?));
    for d in DASHBOARDS {
        out.push((format!("charts/kvgate/files/dashboards/{d}.json"), read(&format!("dashboards/{d}.json"))?));
    }
    let reasons = between(REASONS_DOC, &read(REASONS_DOC)?, BEGIN, END, &kvgate_proto::refusal::markdown_table())?;
    out.push((REASONS_DOC.into(), between(REASONS_DOC, &reasons, CODES_BEGIN, CODES_END, &kvgate_proto::codes::markdown_table())?));
    let values = values_table::markdown(&read("charts/kvgate/values.yaml")?);
    out.push((CHART_README.into(), between(CHART_README, &read(CHART_README)?, VALUES_BEGIN, VALUES_END, &values)?));
    out.push(("docs/cli.md".into(), cli_reference::markdown()?));
    out.push((bench_page::PAGE.into(), benchmarks_page()?));
    Ok(out)
}

/// `docs/benchmarks.md`, refused while its template states a figure of its own or a kept
/// result goes unshown.
fn benchmarks_page() -> anyhow::Result<String> {
    let template = read(bench_page::TEMPLATE)?;
    let bare = bench_page::bare_figures(&template);
    if !bare.is_empty() {
        bail!("measured figures written into the template instead of drawn from bench/results (use {{{{fig ...}}}}):\n{}", bare.join("\n"));
    }
    let (page, used) = bench_page::render(&template)?;
    let mut kept: Vec<String> = std::fs::read_dir(bench_data::dir())
        .context("reading bench/results")?
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".json").map(String::from))
        .filter(|name| !used.contains(name))
        .collect();
    kept.sort();
    if !kept.is_empty() {
        bail!("bench/results/ keeps results that {} does not show: {}", bench_page::TEMPLATE, kept.join(", "));
    }
    Ok(page)
}

/// `doc` (the file `path`) with the text between its markers `begin` and `end` replaced.
fn between(path: &str, doc: &str, begin: &str, end: &str, text: &str) -> anyhow::Result<String> {
    let (Some(b), Some(e)) = (doc.find(begin), doc.find(end)) else { bail!("{path} lacks the markers {begin:?} and {end:?}") };
    Ok(format!("{}{begin}{text}{}", &doc[..b], &doc[e..]))
}

fn dashboards(check: bool) -> anyhow::Result<bool> {
    let mut cmd = Command::new("python3");
    cmd.arg(root().join("dashboards/generate.py"));
    if check {
        cmd.arg("--check");
    }
    let status = cmd.status().context("running python3 dashboards/generate.py (install python3: make test-deps)")?;
    Ok(status.success())
}

fn main() -> anyhow::Result<()> {
    match std::env::args().nth(1).as_deref() {
        Some("generate") => {
            // Dashboards first: the chart copies them.
            if !dashboards(false)? {
                bail!("dashboards/generate.py failed");
            }
            for (path, text) in outputs()? {
                std::fs::write(root().join(&path), text).with_context(|| format!("writing {path}"))?;
            }
            Ok(())
        }
        Some("check") => {
            let mut stale: Vec<String> = Vec::new();
            if !dashboards(true)? {
                stale.push("dashboards/*.json".into());
            }
            for (path, text) in outputs()? {
                if std::fs::read_to_string(root().join(&path)).ok().as_deref() != Some(text.as_str()) {
                    stale.push(path);
                }
            }
            if !stale.is_empty() {
                bail!("stale generated files: {}; run `make generate` (cargo xtask generate) and commit them", stale.join(", "));
            }
            Ok(())
        }
        Some("bench") => {
            let args: Vec<String> = std::env::args().skip(2).collect();
            match args.split_first() {
                Some((name, rest)) if rest.first().map(String::as_str) == Some("--") => bench_run::run(name, &rest[1..]),
                _ => bail!("usage: cargo xtask bench NAME -- COMMAND [ARGS...]"),
            }
        }
        _ => bail!("usage: cargo xtask generate | cargo xtask check | cargo xtask bench NAME -- COMMAND [ARGS...]"),
    }
}
