//! `kubectl kvgate check` against llama.cpp's real server on loopback (the pinned wheel, a tiny
//! random GGUF), through the real kubectl, which finds the plugin on PATH: a server that holds
//! the window passes; one whose slots are smaller is refused with llama.cpp's own numbers; one
//! that shifts its context answers past the window and the boundary probe refuses it. No
//! cluster: the check asks the server itself, as it would through `kubectl port-forward`. The
//! same for kvgate's own workers (`kvgate-worker local`: a router with a prefill and a decode
//! behind it), whose pools check reads unsigned.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kvgate_testenv::process::{Proc, tail};
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

/// A directory of this binary's own under target/tmp, one per test (they run at once).
fn scratch(test: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../target/tmp/engine-check-{test}-{}", std::process::id()))
}

/// The tiny GGUF the engine tests serve, written once for this binary.
fn model() -> PathBuf {
    let model = scratch("llamacpp").join("tiny.gguf");
    kvgate_testenv::models::write(kvgate_testenv::models::Format::Gguf, &model);
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

/// `kvgate-worker local` on a free loopback port with `args` (stopped on drop, as every
/// `Proc`), and its base URL, read from the line where it says where it listens.
fn local_worker(args: &[&str]) -> (Proc, String) {
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/kvgate-worker");
    assert!(bin.is_file(), "{} not found: build it with `cargo build -p kvgate-worker` (make test does)", bin.display());
    let dir = scratch("worker");
    std::fs::create_dir_all(&dir).unwrap();
    let args: Vec<String> = ["local", "--listen", "127.0.0.1:0"].iter().chain(args).map(|a| a.to_string()).collect();
    let mut worker = Proc::spawn("kvgate-worker-local", &bin, &args, &dir).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let log = std::fs::read_to_string(&worker.log).unwrap_or_default();
        if let Some(addr) = log.lines().find_map(|l| l.split("listening on http://").nth(1)?.split_whitespace().next()) {
            return (worker, format!("http://{addr}"));
        }
        worker.check_alive().unwrap();
        assert!(Instant::now() < deadline, "kvgate-worker local {args:?} did not listen within 60 s:\n{}", tail(&worker.log, 20));
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn kubectl_kvgate_check_passes_and_refuses_kvgates_own_workers() {
    // Pools of four windows: 2048 tokens each for a 512-token router.
    let (worker, base) = local_worker(&["--context-window", "512"]);
    let base = base.as_str();
    let (got, out) = check(&[base, "--engine", "kvgate", "--window", "512"]);
    assert_eq!(got, 0, "exit {got}:\n{out}");
    for want in ["passed: kvgate server http://127.0.0.1:", "capacity_tokens 2048 >= contextWindow 512", "read unsigned", "canary: "] {
        assert!(out.contains(want), "no {want:?} in:\n{out}");
    }
    // A window beyond every pool: refused with the pools' own numbers.
    let (got, out) = check(&[base, "--engine", "kvgate", "--window", "4096"]);
    assert!(
        got == 1 && out.contains("refused (KVPoolBelowContextWindow): kvgate server") && out.contains("capacity_tokens 2048 < contextWindow 4096"),
        "exit {got}:\n{out}"
    );
    // Pools that would hold 1024 tokens behind a router that admits 512: the canary's longest
    // prompt is refused with the router's own limit, so the window is not served.
    let (got, out) = check(&[base, "--engine", "kvgate", "--window", "1024"]);
    assert!(got == 1 && out.contains("refused (CanaryFailed)") && out.contains("maximum context length is 512 tokens"), "exit {got}:\n{out}");
    drop(worker);
    std::fs::remove_dir_all(scratch("worker")).unwrap();
}
