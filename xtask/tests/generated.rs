//! No generated file is stale: `cargo xtask check` passes on the tree as committed.

#[test]
fn every_generated_file_is_current() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_xtask")).arg("check").output().unwrap();
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}
