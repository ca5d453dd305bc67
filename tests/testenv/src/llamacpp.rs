//! llama.cpp's real server on loopback, for tests that talk to it as a user's engine: the HTTP
//! server compiled into the pinned `xllamacpp` wheel (`make test-deps` fetches it into
//! `target/images/wheels`), unpacked once per tree, started by the test image's own command
//! line (`images/llamacpp/llama-server`, the same flags as llama.cpp's).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::paths::root;

/// The unpacked wheel (a directory for `PYTHONPATH`), unpacked on first use.
pub fn site() -> PathBuf {
    let wheels = root().join("target/images/wheels");
    let wheel = std::fs::read_dir(&wheels)
        .ok()
        .and_then(|d| d.flatten().map(|e| e.path()).find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("xllamacpp-"))))
        .unwrap_or_else(|| panic!("no xllamacpp wheel in {}: fetch it with `make test-deps` (or `bash scripts/images.sh --fetch`)", wheels.display()));
    // Several tests start llama.cpp at once: the wheel is unpacked once.
    crate::once_dir::make_once(
        &root().join("target/tmp/xllamacpp-site"),
        |d| d.join("xllamacpp").is_dir(),
        |partial| {
            let ok = Command::new("python3")
                .args(["-c", "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])"])
                .arg(&wheel)
                .arg(partial)
                .status()
                .map_err(|e| format!("python3 (make test-deps installs it): {e}"))?;
            if ok.success() { Ok(()) } else { Err(format!("unpacking {}: python3 {ok}", wheel.display())) }
        },
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// A running `llama-server`, killed when dropped.
pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    pub port: u16,
    log: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Its process id (for its RSS).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its log's lines that say something went wrong.
    pub fn errors(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines().filter(|l| l.contains(" E ") || l.contains("Error")).collect::<Vec<_>>().join("\n")
    }
}

/// `llama-server -m model ARGS` on a free loopback port, once its `/health` answers 200 (a
/// server that exits or takes over 300 s panics with its log's errors).
pub fn start(model: &Path, args: &[&str]) -> Server {
    let site = site();
    let port = crate::process::free_port();
    let log = model.with_extension(format!("llama-server-{port}.log"));
    let child = Command::new("python3")
        .arg(root().join("images/llamacpp/llama-server"))
        .args(["-m", &model.display().to_string(), "--host", "127.0.0.1", "--port", &port.to_string()])
        .args(args)
        .env("PYTHONPATH", &site)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap_or_else(|e| panic!("{}: {e}", log.display())))
        .spawn()
        .expect("python3");
    let mut server = Server { child, base: format!("http://127.0.0.1:{port}"), port, log };
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if crate::http::request("GET", &format!("{}/health", server.base), None).is_some_and(|(status, _)| status == 200) {
            return server;
        }
        let exited = server.child.try_wait().unwrap();
        if exited.is_some() || Instant::now() > deadline {
            panic!("llama.cpp's server for {} did not come up ({exited:?}): {}", model.display(), server.errors());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
