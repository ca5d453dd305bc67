//! `docs/cli.md`: every flag of `kvgate-operator`, `kvgate-worker` and `kubectl kvgate`, from
//! their clap definitions, with its environment variable, default and help. A flag without help
//! fails generation, so the reference never has an empty row.

use anyhow::bail;
use clap::{Arg, Command, CommandFactory};

/// The page, whole.
pub fn markdown() -> anyhow::Result<String> {
    let mut out = String::from(
        "# Command-line reference\n\nEvery flag of kvgate's binaries, with the environment variable that sets it, its default and its\nhelp. Generated from the binaries' own definitions by `cargo xtask generate` (`make generate`);\n`make test` fails when this page and the code differ. `--help` on any command prints the same.\n",
    );
    let mut missing = Vec::new();
    for cmd in [kvgate_operator::cli::Cli::command(), kvgate_worker::cli::Cli::command(), kvgate_operator::plugin_cli::Cli::command()] {
        let name = cmd.get_bin_name().unwrap_or(cmd.get_name()).to_string();
        command(&mut out, &cmd, &name, 2, &mut missing);
    }
    if !missing.is_empty() {
        bail!("flags without help (write a doc comment on each): {}", missing.join(", "));
    }
    Ok(out)
}

fn command(out: &mut String, cmd: &Command, path: &str, level: usize, missing: &mut Vec<String>) {
    out.push_str(&format!("\n{} `{path}`\n\n", "#".repeat(level.min(6))));
    if let Some(about) = cmd.get_long_about().or(cmd.get_about()) {
        out.push_str(&format!("{}\n", one_line(&about.to_string())));
    }
    // Global flags are listed where they are defined, not again under every subcommand.
    let args: Vec<&Arg> = cmd.get_arguments().filter(|a| !(level > 2 && a.is_global_set())).collect();
    if !args.is_empty() {
        out.push_str("\n| flag | env | default | meaning |\n| --- | --- | --- | --- |\n");
    }
    for a in args {
        let name = match (a.get_long(), a.get_short()) {
            (Some(l), _) => format!("`--{l}`"),
            (None, Some(s)) => format!("`-{s}`"),
            (None, None) => format!("`{}`", a.get_value_names().and_then(|v| v.first()).map_or_else(|| a.get_id().as_str().to_uppercase(), |v| v.to_string())),
        };
        let env = a.get_env().map(|e| format!("`{}`", e.to_string_lossy())).unwrap_or_default();
        let default: Vec<String> = a.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
        let default = if default.is_empty() { String::new() } else { format!("`{}`", default.join(",")) };
        let mut help = a.get_long_help().or(a.get_help()).map(|h| one_line(&h.to_string())).unwrap_or_default();
        if help.is_empty() {
            missing.push(format!("{path} {name}"));
        }
        let values: Vec<String> = a.get_possible_values().iter().filter(|v| !v.is_hide_set()).map(|v| format!("`{}`", v.get_name())).collect();
        if !values.is_empty() && a.get_action().takes_values() {
            if !help.ends_with('.') {
                help.push('.');
            }
            help.push_str(&format!(" One of {}.", values.join(", ")));
        }
        out.push_str(&format!("| {name} | {env} | {default} | {} |\n", help.replace('|', "\\|")));
    }
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        command(out, sub, &format!("{path} {}", sub.get_name()), level + 1, missing);
    }
}

/// Help text as one Markdown line.
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}
