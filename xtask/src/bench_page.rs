//! `docs/benchmarks.md`, generated from `bench/benchmarks.md.in` and the results `make bench`
//! keeps (`bench/results/*.json`), so that every figure on the page is one a run printed.
//!
//! The template's directives:
//! - a line `{{table NAME}}` (or `{{table NAME#N}}`, the run's N-th table): the table, under a
//!   line naming the run it came from (commit, date, CPU, load);
//! - `{{fig NAME[#N] | ROW | COLUMN[#K]}}` in text: the cell of the row whose label is ROW (or
//!   starts with it) under COLUMN, or its K-th figure;
//! - `{{aim NAME[#N] | ROW | COLUMN[#K] | >= 0.9}}` (or `<=`) in text: that figure and whether
//!   it meets the aim, `0.85x: missed`;
//! - `{{run NAME}}` in text: the run's commit and date.
//!
//! Outside directives the template may not state a measured figure (a ratio like `0.9x` that is
//! not an aim, a rate like `10 tokens/s`): such a figure would not change when the run does.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, bail};

use crate::bench_data::{Results, Table, figures};

pub const TEMPLATE: &str = "bench/benchmarks.md.in";
pub const PAGE: &str = "docs/benchmarks.md";

/// The results a page draws on, loaded once each.
#[derive(Default)]
struct Sources(BTreeMap<String, Results>);

impl Sources {
    fn get(&mut self, name: &str) -> anyhow::Result<&Results> {
        if !self.0.contains_key(name) {
            self.0.insert(name.to_string(), Results::load(name)?);
        }
        Ok(&self.0[name])
    }

    /// `NAME` or `NAME#N`: the results and the table.
    fn table(&mut self, spec: &str) -> anyhow::Result<&Table> {
        let (name, n) = table_spec(spec)?;
        self.get(name)?.table(n)
    }
}

/// `NAME` or `NAME#N` as the results' name and the table's number (1-based).
fn table_spec(spec: &str) -> anyhow::Result<(&str, usize)> {
    match spec.split_once('#') {
        Some((name, n)) => Ok((name, n.parse().with_context(|| format!("table number {n:?}"))?)),
        None => Ok((spec, 1)),
    }
}

fn short(commit: &str) -> &str {
    &commit[..commit.len().min(7)]
}

/// The line above a table: which run it came from.
fn provenance(r: &Results) -> String {
    let run = &r.run;
    let load = match (run.load_before, run.load_after) {
        (Some(b), Some(a)) => format!("load {b:.2} before and {a:.2} after"),
        _ => "load not recorded".into(),
    };
    let took = run.seconds.map(|s| format!(", {:.0} min with its build", s / 60.0)).unwrap_or_default();
    let dirty = if run.dirty { " with uncommitted changes" } else { "" };
    let flags = if run.flags.is_empty() { String::new() } else { format!("; {}", run.flags.join(" ")) };
    let when = if run.date.len() > 10 { format!("{} UTC", run.date) } else { run.date.clone() };
    let note = run.note.as_deref().map(|n| format!(" {n}")).unwrap_or_default();
    format!(
        "*Measured at commit {}{dirty} on {when}: {} ({} CPUs{flags}), {load}{took}; `{}`, kept in `bench/results/{}.json`.{note}*\n",
        short(&run.commit),
        run.cpu,
        run.cores,
        r.command,
        r.bench
    )
}

fn directive(sources: &mut Sources, text: &str) -> anyhow::Result<String> {
    let (verb, rest) = text.trim().split_once(' ').with_context(|| format!("{{{{{text}}}}}: a directive is `table`, `fig` or `run` and its arguments"))?;
    match verb {
        "run" => {
            let r = sources.get(rest.trim())?;
            Ok(format!("commit {} ({})", short(&r.run.commit), &r.run.date[..10]))
        }
        "fig" | "aim" => {
            let parts: Vec<&str> = rest.split(" | ").map(str::trim).collect();
            let (table, row, column, aim) = match (verb, &parts[..]) {
                ("fig", [t, r, c]) => (*t, *r, *c, None),
                ("aim", [t, r, c, a]) => (*t, *r, *c, Some(*a)),
                _ => bail!("{{{{{text}}}}}: `fig TABLE | ROW | COLUMN[#K]` or `aim TABLE | ROW | COLUMN[#K] | >= VALUE`"),
            };
            let (column, k) = match column.rsplit_once('#') {
                Some((c, k)) => (c, Some(k.parse::<usize>().with_context(|| format!("figure number {k:?}"))?)),
                None => (column, None),
            };
            let t = sources.table(table)?;
            let cell = &t.row(row)?[t.column(column)?];
            let figure = match k {
                None => cell.clone(),
                Some(k) => figures(cell).get(k.wrapping_sub(1)).map(|f| f.to_string()).with_context(|| format!("{cell:?} has no figure {k}"))?,
            };
            match aim {
                None => Ok(figure),
                Some(aim) => Ok(format!("{figure}: {}", if meets(&figure, aim)? { "met" } else { "missed" })),
            }
        }
        _ => bail!("{{{{{text}}}}}: unknown directive {verb:?}"),
    }
}

/// Whether `figure` (`0.85x`, `1,061`, `58.9 MiB`) meets `aim` (`>= 0.9`, `<= 64`).
fn meets(figure: &str, aim: &str) -> anyhow::Result<bool> {
    let number = |s: &str| -> anyhow::Result<f64> {
        let first = figures(s).first().copied().with_context(|| format!("{s:?} holds no figure"))?;
        first.trim_end_matches(['x', '%']).replace(',', "").parse().with_context(|| format!("{first:?} is not a number"))
    };
    let (at_least, bound) = match (aim.strip_prefix(">="), aim.strip_prefix("<=")) {
        (Some(b), _) => (true, b),
        (_, Some(b)) => (false, b),
        _ => bail!("aim {aim:?}: `>= VALUE` or `<= VALUE`"),
    };
    let (value, bound) = (number(figure)?, number(bound)?);
    Ok(if at_least { value >= bound } else { value <= bound })
}

/// Text with its inline directives replaced.
fn inline(sources: &mut Sources, line: &str) -> anyhow::Result<String> {
    let mut out = String::new();
    let mut rest = line;
    while let Some(b) = rest.find("{{") {
        let e = rest[b..].find("}}").with_context(|| "an unclosed {{")? + b;
        out += &rest[..b];
        out += &directive(sources, &rest[b + 2..e])?;
        rest = &rest[e + 2..];
    }
    Ok(out + rest)
}

/// The page for a template, and the results it used.
pub fn render(template: &str) -> anyhow::Result<(String, BTreeSet<String>)> {
    let mut sources = Sources::default();
    let mut shown = BTreeSet::new();
    let mut out = String::new();
    for (n, line) in template.lines().enumerate() {
        let at = || format!("{TEMPLATE}:{}", n + 1);
        if let Some(spec) = line.trim().strip_prefix("{{table ").and_then(|s| s.strip_suffix("}}")) {
            let spec = spec.trim();
            let name = table_spec(spec).with_context(at)?.0.to_string();
            let r = sources.get(&name).with_context(at)?;
            out += &if shown.insert(name.clone()) { provenance(r) } else { format!("*From the same run as the table above (`bench/results/{name}.json`).*\n") };
            out.push('\n');
            out += &sources.table(spec).with_context(at)?.markdown();
        } else {
            out += &inline(&mut sources, line).with_context(at)?;
            out.push('\n');
        }
    }
    Ok((out, sources.0.into_keys().collect()))
}

/// Measured figures the template states outside directives, as `line: figure`.
pub fn bare_figures(template: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (n, line) in template.lines().enumerate() {
        let mut text = String::new();
        let mut rest = line;
        while let Some(b) = rest.find("{{") {
            text += &rest[..b];
            text.push_str(" _ ");
            rest = rest[b..].find("}}").map_or("", |e| &rest[b + e + 2..]);
        }
        text += rest;
        for f in figures(&text) {
            let at = text.find(f).unwrap_or(0);
            let before = text[..at].to_ascii_lowercase();
            let after = &text[at + f.len()..];
            let aim = ["at least ", "at most ", ">= ", "<= ", "aim "].iter().any(|w| before.ends_with(w));
            let rate = after.split_whitespace().next().is_some_and(|w| w.ends_with("/s") || w.ends_with("/s,") || w.ends_with("/s)"));
            if (f.ends_with('x') && !aim) || rate {
                found.push(format!("{TEMPLATE}:{}: {f}", n + 1));
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_in_prose_are_found_and_aims_are_not() {
        let t = "aim: at least 0.7x\nit ran at 0.66x here\n{{fig a | b | c}} tokens/s\n2,122 MiB/s over 8 KiB pages\nat most 1.3x, or >= 0.9x\n";
        assert_eq!(bare_figures(t), [format!("{TEMPLATE}:2: 0.66x"), format!("{TEMPLATE}:4: 2,122")]);
    }

    #[test]
    fn an_aim_is_judged_on_the_figure() {
        assert!(meets("0.99x", ">= 0.9").unwrap());
        assert!(!meets("0.85x", ">= 0.9").unwrap());
        assert!(meets("58.9 MiB", "<= 64").unwrap());
        assert!(!meets("1,062", "<= 1000").unwrap());
        assert!(meets("-", ">= 1").is_err());
        assert!(meets("1x", "> 1").is_err());
    }
}
