//! The build scripts must not fail at random: printing the first line of a chatty binary's version
//! output with `cmd | head -1` under `pipefail` dies with SIGPIPE (exit 141) whenever the binary
//! writes after `head` has exited. It broke `make test` twice, in two scripts.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Stand-ins for the built binaries: each prints its version line, then a lot more.
fn chatty_binaries(dir: &Path, binaries: &[(&str, &str)]) {
    std::fs::create_dir_all(dir).unwrap();
    for (name, first) in binaries {
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\necho '{first}'\nseq 1 200000\n")).unwrap();
        Command::new("chmod").arg("+x").arg(&path).status().unwrap();
    }
}

/// Runs `script` in its versions-only mode ten times: it must succeed and print exactly `want`.
fn versions_survive_chatty_binaries(script: &str, bin_var: &str, only_var: &str, binaries: &[(&str, &str)]) {
    let dir = std::env::temp_dir().join(format!("kvgate-build-script-{}-{bin_var}", std::process::id()));
    chatty_binaries(&dir, binaries);
    let want: Vec<&str> = binaries.iter().map(|(_, first)| *first).collect();
    for run in 0..10 {
        let out = Command::new("bash").arg(root().join(script)).env(bin_var, &dir).env(only_var, "1").output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{script}, run {run}: {:?}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
        assert_eq!(stdout.lines().collect::<Vec<_>>(), want, "{script}, run {run}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_control_plane_script_prints_versions_of_binaries_that_keep_writing() {
    versions_survive_chatty_binaries(
        "tests/controlplane/build.sh",
        "CONTROLPLANE_BIN",
        "CONTROLPLANE_VERSIONS_ONLY",
        &[("kube-apiserver", "Kubernetes v1.37.2"), ("etcd", "etcd Version: 3.7.3")],
    );
}

#[test]
fn the_tools_script_prints_versions_of_binaries_that_keep_writing() {
    versions_survive_chatty_binaries(
        "tests/tools/build.sh",
        "TOOLS_BIN",
        "TOOLS_VERSIONS_ONLY",
        &[
            ("helm", "v3.22.0+g"),
            ("ct", "Version: v3.14.0"),
            ("jaeger", r#"{"gitVersion":"v1.76.0"}"#),
            ("alertmanager", "alertmanager, version 0.35.0"),
            ("registry", "github.com/distribution/distribution/v3 v3.1.2"),
        ],
    );
}

/// Every shell script and the Makefile: no pipe into a reader that stops early (`head`,
/// `grep -q`, `grep -m`) in a script that sets `pipefail`, or in a recipe (make runs them under
/// the scripts' own shells, which may set it).
#[test]
fn no_script_pipes_into_a_reader_that_exits_early() {
    let early = ["| head", "|head", "| grep -q", "| grep -m", "| sed -n 1p", "| sed 1q"];
    let mut scripts = Vec::new();
    collect(&root(), &mut scripts);
    assert!(scripts.len() >= 8, "found only {scripts:?}");
    let mut offenders = Vec::new();
    for path in &scripts {
        let text = std::fs::read_to_string(path).unwrap();
        let pipefail = text.contains("pipefail") || path.ends_with("Makefile");
        for (n, line) in text.lines().enumerate() {
            let code = line.split(" #").next().unwrap_or(line);
            if pipefail && !line.trim_start().starts_with('#') && early.iter().any(|p| code.contains(p)) {
                offenders.push(format!("{}:{}: {}", path.strip_prefix(root()).unwrap_or(path).display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "pipes that die with SIGPIPE (141) under pipefail; capture the output and cut it (first_line in tests/go-build.sh):\n{}",
        offenders.join("\n")
    );
}

/// The repository's shell scripts and Makefile, outside target/ and .git/.
fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !matches!(name.as_str(), "target" | ".git" | "node_modules") {
                collect(&path, out);
            }
        } else if name.ends_with(".sh") || name == "Makefile" || path.parent().and_then(|p| p.file_name()).is_some_and(|d| d == ".ci") {
            out.push(path);
        }
    }
}
