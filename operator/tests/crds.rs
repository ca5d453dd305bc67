//! `crds/` is what `kvgate-operator crd` prints: regenerate with
//! `make generate` (which also writes the chart's copy).

#[test]
fn crds_dir_is_not_stale() {
    let want = kvgate_operator::crdgen::yaml().unwrap();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(kvgate_operator::crdgen::FILE);
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(have == want, "{} is stale: run `make generate`", path.display());
}

#[test]
fn the_binary_prints_the_same_crds() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate-operator")).arg("crd").output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), kvgate_operator::crdgen::yaml().unwrap());
}
