//! What `make bench` keeps of a benchmark's run: `bench/results/<name>.json`, the Markdown
//! tables the benchmark printed and the run they came from (commit, date, CPU, load), from
//! which `docs/benchmarks.md` is generated (`bench_page`).

use std::path::PathBuf;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

/// One benchmark's latest run.
#[derive(Debug, Serialize, Deserialize)]
pub struct Results {
    /// The benchmark's name (the file's stem).
    pub bench: String,
    /// The command `make bench` ran.
    pub command: String,
    pub run: Run,
    /// Every Markdown table the command printed, in order.
    pub tables: Vec<Table>,
}

/// Where and when the figures were taken.
#[derive(Debug, Serialize, Deserialize)]
pub struct Run {
    /// The commit measured (full hash).
    pub commit: String,
    /// Whether the tree had uncommitted changes to tracked files (other than the results and
    /// the page a bench run writes).
    pub dirty: bool,
    /// UTC, `YYYY-MM-DD HH:MM`.
    pub date: String,
    /// `/proc/cpuinfo`'s model name.
    pub cpu: String,
    /// Logical CPUs online.
    pub cores: usize,
    /// Of the CPU features kvgate's kernels choose between, those this CPU has.
    pub flags: Vec<String>,
    /// The one-minute load average before and after (`None`: not recorded).
    pub load_before: Option<f64>,
    pub load_after: Option<f64>,
    /// Wall time of the command, its build included.
    pub seconds: Option<f64>,
    /// Set on results that were not written by `cargo xtask bench`: where they came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Table {
    pub header: Vec<String>,
    /// The separator row as printed (`---`, `---:`), kept for alignment.
    pub align: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

/// The CPU features worth naming beside a figure: the ones `worker/src/cpu/` and the page tag
/// dispatch on.
pub const FLAGS: [&str; 8] = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "vaes", "vpclmulqdq"];

/// `bench/results/`, or `KVGATE_BENCH_RESULTS` (a test's own directory).
pub fn dir() -> PathBuf {
    std::env::var_os("KVGATE_BENCH_RESULTS").map(PathBuf::from).unwrap_or_else(|| crate::root().join("bench/results"))
}

impl Results {
    pub fn load(name: &str) -> anyhow::Result<Results> {
        let path = dir().join(format!("{name}.json"));
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}: run `make bench` (or its {name} step)", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    pub fn save(&self) -> anyhow::Result<()> {
        std::fs::create_dir_all(dir())?;
        let path = dir().join(format!("{}.json", self.bench));
        std::fs::write(&path, serde_json::to_string_pretty(self)? + "\n").with_context(|| format!("writing {}", path.display()))
    }

    /// Table `n` (1-based).
    pub fn table(&self, n: usize) -> anyhow::Result<&Table> {
        match self.tables.get(n.wrapping_sub(1)) {
            Some(t) => Ok(t),
            None => bail!("bench/results/{}.json has {} tables, not a table {n}", self.bench, self.tables.len()),
        }
    }
}

fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    inner.split('|').map(|c| c.trim().to_string()).collect()
}

/// The Markdown tables in a benchmark's output: runs of lines that start with `|`, whose second
/// line is the separator.
pub fn parse_tables(output: &str) -> anyhow::Result<Vec<Table>> {
    let mut tables = Vec::new();
    let lines: Vec<&str> = output.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        if !lines[i].trim_start().starts_with('|') {
            i += 1;
            continue;
        }
        let start = i;
        while i < lines.len() && lines[i].trim_start().starts_with('|') {
            i += 1;
        }
        let block = &lines[start..i];
        let header = cells(block[0]);
        let align = block.get(1).map(|l| cells(l)).unwrap_or_default();
        if align.len() != header.len() || !align.iter().all(|c| !c.is_empty() && c.chars().all(|ch| ch == '-' || ch == ':')) {
            bail!("output line {}: a table without a separator row under its header: {}", start + 1, block[0]);
        }
        let rows: Vec<Vec<String>> = block[2..].iter().map(|l| cells(l)).collect();
        if let Some((n, r)) = rows.iter().enumerate().find(|(_, r)| r.len() != header.len()) {
            bail!("output line {}: {} cells under a header of {}", start + 3 + n, r.len(), header.len());
        }
        tables.push(Table { header, align, rows });
    }
    Ok(tables)
}

impl Table {
    pub fn markdown(&self) -> String {
        let line = |cells: &[String]| format!("| {} |\n", cells.join(" | "));
        let mut out = line(&self.header) + &line(&self.align);
        for r in &self.rows {
            out += &line(r);
        }
        out
    }

    /// The one row whose first cell is `label`, or the one that starts with it.
    pub fn row(&self, label: &str) -> anyhow::Result<&[String]> {
        if let Some(r) = self.rows.iter().find(|r| r[0] == label) {
            return Ok(r);
        }
        let found: Vec<&Vec<String>> = self.rows.iter().filter(|r| r[0].starts_with(label)).collect();
        match found.as_slice() {
            [one] => Ok(one),
            [] => bail!("no row starts with {label:?}"),
            many => bail!("{} rows start with {label:?}: {}", many.len(), many.iter().map(|r| r[0].as_str()).collect::<Vec<_>>().join("; ")),
        }
    }

    /// The index of the column headed `name`.
    pub fn column(&self, name: &str) -> anyhow::Result<usize> {
        self.header.iter().position(|h| h == name).with_context(|| format!("no column {name:?} (columns: {})", self.header.join("; ")))
    }
}

/// The figures in a cell, in order: numbers with their thousands commas, decimals and a
/// trailing `x` (a ratio) or `%`.
pub fn figures(cell: &str) -> Vec<&str> {
    let b = cell.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let starts = b[i].is_ascii_digit() && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_' || b[i - 1] == b'.'));
        if !starts {
            i += 1;
            continue;
        }
        let s = i;
        while i < b.len() && (b[i].is_ascii_digit() || (matches!(b[i], b'.' | b',') && i + 1 < b.len() && b[i + 1].is_ascii_digit())) {
            i += 1;
        }
        if i < b.len() && (b[i] == b'x' || b[i] == b'%') && (i + 1 == b.len() || !b[i + 1].is_ascii_alphanumeric()) {
            i += 1;
        }
        // A figure glued to letters (`8B`, `q8_0`, `x86`) is a name, not a figure.
        if i < b.len() && (b[i].is_ascii_alphabetic() || b[i] == b'_') {
            while i < b.len() && b[i].is_ascii_alphanumeric() {
                i += 1;
            }
            continue;
        }
        out.push(&cell[s..i]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_read_from_output_between_other_lines() {
        let out = "warming up\n| a | b |\n| --- | ---: |\n| x, 1 | 2 |\n\n(note)\n| c |\n| --- |\n| 3 |\nwrote x.csv\n";
        let t = parse_tables(out).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].header, ["a", "b"]);
        assert_eq!(t[0].align, ["---", "---:"]);
        assert_eq!(t[0].rows, [["x, 1", "2"]]);
        assert_eq!(t[1].rows, [["3"]]);
        assert_eq!(t[0].markdown(), "| a | b |\n| --- | ---: |\n| x, 1 | 2 |\n");
    }

    #[test]
    fn a_table_without_separator_or_with_a_short_row_is_refused() {
        assert!(parse_tables("| a | b |\n| 1 | 2 |\n").unwrap_err().to_string().contains("separator"));
        assert!(parse_tables("| a | b |\n| - | - |\n| 1 |\n").unwrap_err().to_string().contains("1 cells under a header of 2"));
    }

    #[test]
    fn figures_skip_names_and_keep_ratios() {
        assert_eq!(figures("2122 MiB/s, 1,061 pages/s (482.6 ms)"), ["2122", "1,061", "482.6"]);
        assert_eq!(figures("0.66x, 1.50x slower"), ["0.66x", "1.50x"]);
        assert_eq!(figures("8B-shaped q8_0 x86 at 80%"), ["80%"]);
    }

    #[test]
    fn a_row_is_found_by_its_label_or_a_unique_prefix() {
        let t = Table {
            header: vec!["k".into(), "v".into()],
            align: vec!["---".into(); 2],
            rows: vec![vec!["ab".into(), "1".into()], vec!["abc".into(), "2".into()], vec!["b1".into(), "3".into()]],
        };
        assert_eq!(t.row("ab").unwrap()[1], "1");
        assert_eq!(t.row("abc").unwrap()[1], "2");
        assert!(t.row("a").is_err());
        assert_eq!(t.row("b").unwrap()[1], "3");
        assert!(t.column("w").unwrap_err().to_string().contains("columns: k; v"));
    }
}
