//! `tests/controlplane/build.sh` must not fail at random: printing the first line of a chatty
//! binary's version output used to die with SIGPIPE (exit 141) under `pipefail`.

use std::path::PathBuf;
use std::process::Command;

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../controlplane/build.sh")
}

#[test]
fn printing_versions_survives_binaries_that_keep_writing_after_the_first_line() {
    let dir = std::env::temp_dir().join(format!("kvgate-build-script-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Stand-ins that print their version and then much more, as a real binary might.
    for (name, first) in [("kube-apiserver", "Kubernetes v1.37.2"), ("etcd", "etcd Version: 3.7.3")] {
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\necho '{first}'\nseq 1 200000\n")).unwrap();
        std::process::Command::new("chmod").arg("+x").arg(&path).status().unwrap();
    }
    for run in 0..10 {
        let out = Command::new("bash").arg(script()).env("CONTROLPLANE_BIN", &dir).env("CONTROLPLANE_VERSIONS_ONLY", "1").output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "run {run}: {:?}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
        assert_eq!(stdout.lines().collect::<Vec<_>>(), ["Kubernetes v1.37.2", "etcd Version: 3.7.3"], "run {run}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}
