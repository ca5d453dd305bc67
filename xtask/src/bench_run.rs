//! `cargo xtask bench NAME -- COMMAND...`: runs one benchmark as `make bench` does, passing its
//! output through, and keeps the tables it printed with the run's facts in
//! `bench/results/NAME.json` (`bench_data`). A failed command or one that printed no table
//! keeps the previous results.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};

use crate::bench_data::{FLAGS, Results, Run, parse_tables};

fn git(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("git").args(args).current_dir(crate::root()).output().context("running git")?;
    anyhow::ensure!(out.status.success(), "git {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

/// The CPU's model name and the features of `FLAGS` it has, from `/proc/cpuinfo`.
fn cpu() -> (String, Vec<String>) {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| info.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_once(':')).map(|(_, v)| v.trim().to_string());
    let model = field("model name").unwrap_or_else(|| "unknown CPU".into());
    let have: Vec<String> = field("flags").unwrap_or_default().split_whitespace().map(String::from).collect();
    (model, FLAGS.iter().filter(|f| have.iter().any(|h| h == *f)).map(|f| f.to_string()).collect())
}

fn utc_now() -> anyhow::Result<String> {
    let out = Command::new("date").args(["-u", "+%Y-%m-%d %H:%M"]).output().context("running date")?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

pub fn run(name: &str, command: &[String]) -> anyhow::Result<()> {
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-') {
        bail!("bench name {name:?}: use lowercase letters, digits and dashes (it names bench/results/NAME.json)");
    }
    let Some((program, args)) = command.split_first() else { bail!("usage: cargo xtask bench NAME -- COMMAND [ARGS...]") };
    let commit = git(&["rev-parse", "HEAD"])?;
    // What `make bench` itself writes (the results and the page) does not make the tree dirty.
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results", ":!docs/benchmarks.md"])?.is_empty();
    let (date, load_before, started) = (utc_now()?, load_average(), Instant::now());
    let mut child = Command::new(program).args(args).stdout(Stdio::piped()).spawn().with_context(|| format!("starting {program}"))?;
    let mut output = String::new();
    let stdout = std::io::stdout();
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line.context("reading the benchmark's output")?;
        writeln!(stdout.lock(), "{line}")?;
        output += &line;
        output.push('\n');
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("{} failed ({status}); bench/results/{name}.json keeps its previous run", command.join(" "));
    }
    let tables = parse_tables(&output)?;
    if tables.is_empty() {
        bail!("{} printed no Markdown table; bench/results/{name}.json keeps its previous run", command.join(" "));
    }
    let (cpu, flags) = cpu();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let run = Run {
        commit,
        dirty,
        date,
        cpu,
        cores,
        flags,
        load_before,
        load_after: load_average(),
        seconds: Some((started.elapsed().as_secs_f64() * 10.0).round() / 10.0),
        note: None,
    };
    Results { bench: name.into(), command: command.join(" "), run, tables }.save()?;
    eprintln!("wrote {}; `cargo xtask generate` puts it in docs/benchmarks.md", crate::bench_data::dir().join(format!("{name}.json")).display());
    Ok(())
}
