//! The test world's own network namespace.
//!
//! A binary that writes `kvgate_testenv::own_network_namespace!()` moves into a fresh network
//! namespace before `main` runs (while it still has one thread, so every thread and child process
//! it ever starts is inside): etcd, the API server, the node agent, the pods' bridge and the tests'
//! own connections live there, and the host's interfaces, routes and firewall are never touched.
//! The namespace has no name in `/run/netns`; it disappears with the last process in it. Every
//! process of the world carries `KVGATE_WORLD=<pid of the binary>`, which tells a child that it is
//! already inside, and lets the next run find what a killed run left behind (`sweep`).
//! The host is reached only through `in_host` (the relays bind 127.0.0.1 there).

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicI32, Ordering};

/// The environment variable every process of a world carries: the pid of the world's binary.
pub const WORLD: &str = "KVGATE_WORLD";

static HOST: AtomicI32 = AtomicI32::new(-1);
static ENTER_ERRNO: AtomicI32 = AtomicI32::new(0);

/// Moves the calling binary into its own network namespace before `main` (see the module docs).
#[macro_export]
macro_rules! own_network_namespace {
    () => {
        #[used]
        #[unsafe(link_section = ".init_array")]
        static KVGATE_OWN_NETWORK_NAMESPACE: extern "C" fn() = {
            extern "C" fn enter() {
                $crate::netns::enter_before_main();
            }
            enter
        };
    };
}

/// Called from `.init_array`, single-threaded: keep a handle on the host's namespace, unshare,
/// bring `lo` up, mark the environment. Failures are kept for `require` to report.
pub fn enter_before_main() {
    if std::env::var_os(WORLD).is_some() {
        return;
    }
    // SAFETY: plain syscalls on the only thread; the fds stay open for the process's life.
    unsafe {
        let host = libc::open(c"/proc/self/ns/net".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if host < 0 || libc::unshare(libc::CLONE_NEWNET) != 0 {
            ENTER_ERRNO.store(*libc::__errno_location(), Ordering::SeqCst);
            return;
        }
        if let Err(errno) = loopback_up() {
            ENTER_ERRNO.store(errno, Ordering::SeqCst);
            return;
        }
        HOST.store(host, Ordering::SeqCst);
        // SAFETY: no other thread exists yet to read the environment concurrently.
        std::env::set_var(WORLD, std::process::id().to_string());
    }
}

/// `ip link set lo up` through the SIOCSIFFLAGS ioctl (no allocation, no child process).
///
/// # Safety
///
/// Called from the startup hook above, on the process's only thread, inside the namespace it
/// just entered: the ioctls read and write only the `ifreq` on this stack.
unsafe fn loopback_up() -> Result<(), i32> {
    // SAFETY: a zeroed ifreq named "lo" is a valid argument for both ioctls.
    unsafe {
        let sock = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if sock < 0 {
            return Err(*libc::__errno_location());
        }
        let mut req: libc::ifreq = std::mem::zeroed();
        req.ifr_name[0] = b'l' as libc::c_char;
        req.ifr_name[1] = b'o' as libc::c_char;
        let ok = libc::ioctl(sock, libc::SIOCGIFFLAGS, &mut req) == 0 && {
            req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            libc::ioctl(sock, libc::SIOCSIFFLAGS, &req) == 0
        };
        let errno = *libc::__errno_location();
        libc::close(sock);
        if ok { Ok(()) } else { Err(errno) }
    }
}

/// Fails unless this process lives in a world's namespace (its own or a parent's), saying why.
pub fn require() -> anyhow::Result<()> {
    if HOST.load(Ordering::SeqCst) >= 0 {
        return Ok(());
    }
    match ENTER_ERRNO.load(Ordering::SeqCst) {
        0 if std::env::var_os(WORLD).is_some() => Ok(()),
        0 => anyhow::bail!(
            "this binary is not in a network namespace of its own: write `kvgate_testenv::own_network_namespace!();` in it (the test world never runs in the host's namespace)"
        ),
        errno => anyhow::bail!(
            "creating the test world's network namespace failed: {}: the control-plane tests need CAP_SYS_ADMIN and CAP_NET_ADMIN (run them as root)",
            std::io::Error::from_raw_os_error(errno)
        ),
    }
}

/// A new network namespace, held open by a child process (`sleep infinity` unshared into it, the
/// part a pause container plays) until that is killed; it is `/proc/<pid>/ns/net`.
pub fn holder(what: &str) -> anyhow::Result<std::process::Child> {
    use std::os::unix::process::CommandExt;
    let mut holder = std::process::Command::new("sleep");
    holder.arg("infinity").stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
    // SAFETY: unshare is a single syscall in the forked child.
    unsafe {
        holder.pre_exec(|| if libc::unshare(libc::CLONE_NEWNET) == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) });
    }
    holder.spawn().map_err(|e| anyhow::anyhow!("starting the process that holds {what}'s network namespace (sleep, from coreutils): {e}"))
}

/// The host's namespace, when this process left it.
pub fn host() -> Option<RawFd> {
    Some(HOST.load(Ordering::SeqCst)).filter(|fd| *fd >= 0)
}

/// Runs `f` on a thread in the host's network namespace: sockets it creates stay there.
pub fn in_host<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> anyhow::Result<T> {
    let fd = host().ok_or_else(|| anyhow::anyhow!("this process never left the host's network namespace"))?;
    std::thread::spawn(move || {
        // SAFETY: setns on this fresh thread only; it ends right after `f`.
        if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } != 0 {
            return Err(anyhow::anyhow!("entering the host's network namespace: {}", std::io::Error::last_os_error()));
        }
        Ok(f())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("a thread in the host's namespace panicked"))?
}

/// Kills what a world whose binary no longer runs left behind (a SIGKILLed test binary's etcd,
/// node agent, pods), so its namespace goes away with them.
pub fn sweep() {
    for (pid, owner) in members() {
        if owner != pid && !crate::process::alive(owner) {
            tracing::info!(pid, owner, "stopping a process left by a test world whose binary exited");
            // SAFETY: the process belongs to a dead world of ours (it carries its marker).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// `(pid, owner)` of every process that carries a world's marker (`WORLD=owner`).
pub fn members() -> Vec<(i32, i32)> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    let prefix = format!("{WORLD}=");
    entries
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<i32>().ok()?;
            let environ = std::fs::read(entry.path().join("environ")).ok()?;
            let owner = environ.split(|b| *b == 0).find_map(|kv| kv.strip_prefix(prefix.as_bytes()))?;
            Some((pid, std::str::from_utf8(owner).ok()?.parse().ok()?))
        })
        .collect()
}
