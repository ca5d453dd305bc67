//! `kubectl kvgate check` against llama.cpp's real server on loopback (the pinned wheel, a tiny
//! random GGUF), through the real kubectl, which finds the plugin on PATH: a server that holds
//! the window passes; one whose slots are smaller is refused with llama.cpp's own numbers; one
//! that shifts its context answers past the window and the boundary probe refuses it. No
//! cluster: the check asks the server itself, as it would through `kubectl port-forward`.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvgate_testenv::{controlplane::kubectl_path, llamacpp};

/// `kubectl kvgate check ARGS`: its exit code, and stdout then stderr.
fn check(args: &[&str]) -> (i32, String) {
    let plugin = Path::new(env!("CARGO_BIN_EXE_kubectl-kvgate"));
    let path = format!("{}:{}", plugin.parent().unwrap().display(), std::env::var("PATH").unwrap_or_default());
    let out = Command::new(kubectl_path())
        .args(["kvgate", "check"])
        .args(args)
        .env("PATH", path)
        .output()
        .expect("kubectl not found: build it with `make controlplane`");
    (out.status.code().unwrap_or(-1), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// The tiny GGUF the engine tests serve, written once for this binary.
fn model() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../target/tmp/engine-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/engines/models.sh");
    let out = Command::new("bash").arg(script).arg("gguf").arg(&model).output().unwrap();
    assert!(out.status.success(), "writing the GGUF model: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    model
}

#[test]
fn kubectl_kvgate_check_passes_and_refuses_a_real_llamacpp_server_with_its_own_numbers() {
    let model = model();
    let window = ["--engine", "llamacpp", "--window", "4096"];
    let cases: [(&[&str], i32, &[&str]); 3] = [
        (&["-c", "4096", "-np", "1"], 0, &["passed: llamacpp server http://127.0.0.1:", "n_ctx per slot 4096 >= contextWindow 4096", "canary: "]),
        (
            &["-c", "4096", "-np", "4"],
            1,
            &["refused (KVPoolBelowContextWindow): llamacpp server http://127.0.0.1:", "n_ctx per slot 1024 < contextWindow 4096"],
        ),
        (&["-c", "4096", "--context-shift"], 1, &["refused (BoundaryProbeAnswered): ", "past contextWindow 4096"]),
    ];
    for (args, code, wants) in cases {
        let server = llamacpp::start(&model, args);
        let (got, out) = check(&[&[server.base.as_str()][..], &window].concat());
        assert_eq!(got, code, "llama-server {args:?}: exit {got}:\n{out}\n{}", server.errors());
        for want in wants {
            assert!(out.contains(want), "llama-server {args:?}: no {want:?} in:\n{out}");
        }
    }
    // What cannot be checked says so and exits 2: nothing listening, an engine it does not know.
    let closed = format!("http://127.0.0.1:{}", kvgate_testenv::process::free_port());
    let (got, out) = check(&[&[closed.as_str()][..], &window].concat());
    assert!(got == 2 && out.contains(&closed), "exit {got}: {out}");
    let (got, out) = check(&[closed.as_str(), "--engine", "tgi", "--window", "4096"]);
    assert!(got == 2 && out.contains("\"tgi\" is not one of"), "exit {got}: {out}");
    std::fs::remove_dir_all(model.parent().unwrap()).unwrap();
}
