//! docs/worker.md's "One machine, no Kubernetes" section, run as written: `kvgate-worker local` with
//! no flags (what `make run` runs, here the debug build), then every `curl` line of the section
//! through `sh`, each answered the way the page says.

mod support;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The commands of a block: continuation lines joined, comments dropped.
fn commands(block: &str) -> Vec<String> {
    let joined = block.replace("\\\n", " ");
    joined.lines().map(|l| l.split(" # ").next().unwrap().trim().to_string()).filter(|l| !l.is_empty()).collect()
}

struct Local(Child);

impl Drop for Local {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_one_machine_commands_work_as_written() {
    let blocks = kvgate_testenv::readme::blocks("docs/worker.md", "## One machine, no Kubernetes");
    assert!(blocks[0].contains("make run") && blocks[0].contains("kvgate-worker -- local"), "{}", blocks[0]);
    assert!(
        std::net::TcpStream::connect("127.0.0.1:8080").is_err(),
        "127.0.0.1:8080 is taken: docs/worker.md's commands use it; stop what listens there and run again"
    );
    let mut local = Local(Command::new(env!("CARGO_BIN_EXE_kvgate-worker")).arg("local").stdout(Stdio::null()).stderr(Stdio::inherit()).spawn().unwrap());
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect("127.0.0.1:8080").is_err() {
        assert!(local.0.try_wait().unwrap().is_none(), "kvgate-worker local exited");
        assert!(Instant::now() < deadline, "kvgate-worker local did not listen on 127.0.0.1:8080 within 60 s");
        std::thread::sleep(Duration::from_millis(100));
    }

    let curls = commands(&blocks[1]);
    assert_eq!(curls.len(), 4, "{curls:?}");
    let mut outputs = Vec::new();
    for c in &curls {
        assert!(c.starts_with("curl "), "{c}");
        let out =
            Command::new("sh").arg("-c").arg(format!("{c} --fail --max-time 60")).output().expect("sh and curl are needed (make test-deps installs curl)");
        assert!(out.status.success(), "`{c}` failed: {}", String::from_utf8_lossy(&out.stderr));
        outputs.push(String::from_utf8(out.stdout).unwrap());
    }
    let completion: Value = serde_json::from_str(&outputs[0]).unwrap();
    assert_eq!(completion["object"], "text_completion", "{completion}");
    assert!(completion["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{completion}");
    assert!(outputs[1].lines().any(|l| l.starts_with("data: {")) && outputs[1].contains("data: [DONE]"), "{}", outputs[1]);
    // The router's pool endpoint shows what each peer measured: four windows of 8192 tokens.
    let pools: Value = serde_json::from_str(&outputs[2]).unwrap();
    for role in ["prefill", "decode"] {
        let peers = pools[role].as_array().unwrap_or_else(|| panic!("no {role} in {pools}"));
        assert_eq!(peers.len(), 1, "{pools}");
        assert_eq!(peers[0]["report"]["capacity_tokens"], 32768, "{pools}");
    }
    for role in ["router", "prefill", "decode"] {
        assert!(outputs[3].contains(&format!("role=\"{role}\"")), "/metrics lacks role {role}");
    }
}
