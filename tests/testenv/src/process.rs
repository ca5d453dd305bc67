//! Child processes that never outlive the test binary: each runs in its own process group, is
//! stopped (SIGTERM, then SIGKILL) on drop, and is also stopped by an exit hook for the ones
//! held in statics, which Rust never drops.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static LIVE: Mutex<Vec<i32>> = Mutex::new(Vec::new());

/// SIGTERM first, so components clean up after themselves (the node agent removes its pod
/// addresses), then SIGKILL for whatever is left after two seconds.
extern "C" fn kill_all_at_exit() {
    let Ok(pids) = LIVE.lock() else { return };
    for pid in pids.iter() {
        // SAFETY: signalling a process group we created; no memory is touched.
        unsafe { libc::kill(-pid, libc::SIGTERM) };
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    // Reap the leaders we started (a zombie still counts as alive), then wait for their groups.
    // SAFETY: reaping our own child (no status written: a null pointer) and probing its group.
    let alive = |pid: &i32| unsafe {
        libc::waitpid(*pid, std::ptr::null_mut(), libc::WNOHANG);
        libc::kill(-pid, 0) == 0
    };
    while Instant::now() < deadline && pids.iter().any(alive) {
        std::thread::sleep(Duration::from_millis(20));
    }
    for pid in pids.iter() {
        // SAFETY: as for SIGTERM above.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
    }
}

fn register(pid: i32) {
    static HOOK: std::sync::Once = std::sync::Once::new();
    // SAFETY: registers a plain extern "C" function once.
    HOOK.call_once(|| unsafe {
        libc::atexit(kill_all_at_exit);
    });
    LIVE.lock().unwrap().push(pid);
}

/// A component process with its output in a log file.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    pub log: PathBuf,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    child: Child,
}

impl Proc {
    pub fn spawn(name: &str, program: &Path, args: &[String], log_dir: &Path) -> anyhow::Result<Proc> {
        Proc::spawn_with_env(name, program, args, &[], log_dir)
    }

    /// The same with variables added to the process's environment (kept for `restart`).
    pub fn spawn_with_env(name: &str, program: &Path, args: &[String], env: &[(String, String)], log_dir: &Path) -> anyhow::Result<Proc> {
        let log = log_dir.join(format!("{name}.log"));
        let child = launch(program, args, env, std::fs::File::create(&log)?)?;
        Ok(Proc { name: name.into(), log, program: program.into(), args: args.to_vec(), env: env.to_vec(), child })
    }

    /// Stops the process and starts it again with the same arguments, its output appended.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        self.child = launch(&self.program, &self.args, &self.env, std::fs::OpenOptions::new().append(true).open(&self.log)?)?;
        Ok(())
    }

    /// SIGKILL, no warning: the process cannot clean up or hand anything over (a crash, an
    /// OOM kill, a node lost).
    pub fn kill(&mut self) {
        let pid = self.child.id() as i32;
        // SAFETY: signalling the process group we created.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
        let _ = self.child.wait();
        LIVE.lock().unwrap().retain(|p| *p != pid);
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Fails with the log's tail if the process already exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            anyhow::bail!("{} exited ({status}):\n{}", self.name, tail(&self.log, 40));
        }
        Ok(())
    }

    pub fn stop(&mut self) {
        let pid = self.child.id() as i32;
        // SAFETY: signalling the process group we created.
        unsafe {
            libc::kill(-pid, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // SAFETY: as above; harmless if the group is gone.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
        let _ = self.child.wait();
        LIVE.lock().unwrap().retain(|p| *p != pid);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

fn launch(program: &Path, args: &[String], env: &[(String, String)], log: std::fs::File) -> anyhow::Result<Child> {
    let child = Command::new(program)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .map_err(|e| anyhow::anyhow!("starting {}: {e}", program.display()))?;
    register(child.id() as i32);
    Ok(child)
}

/// Whether `pid` runs: exists and is not a zombie (an orphan's zombie lingers until its new
/// parent reaps it, which in a container's init may be never).
pub fn alive(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    // `pid (comm) STATE ...`; comm may contain spaces and parentheses, so look after the last ')'.
    stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()).is_some_and(|state| state != "Z" && state != "X")
}

/// The last `lines` lines of a log file.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A free TCP port on 127.0.0.1 (bound and released; good enough for a test harness).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}
