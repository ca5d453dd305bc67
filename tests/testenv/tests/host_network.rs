//! The test world never touches the host's network. A whole world (control plane, node agent, a
//! pod on its bridge) runs in a child process, reached from the host only through its relays on
//! 127.0.0.1; then it is SIGKILLed, and what it left is swept as the next run sweeps it. The host's
//! namespaces, addresses, links, routes and firewall ruleset are exactly what they were, while it
//! runs and after.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvgate_testenv::netns::{self, WORLD};
use kvgate_testenv::wait::eventually;

kvgate_testenv::own_network_namespace!();

/// What the host's network looks like, with lifetimes that tick by themselves left out.
fn host_state() -> String {
    let commands: [&[&str]; 6] = [
        &["ip", "netns", "list"],
        &["ip", "-o", "addr"],
        &["ip", "-o", "link"],
        &["ip", "route", "show", "table", "all"],
        &["ip", "-6", "route", "show", "table", "all"],
        &["nft", "list", "ruleset"],
    ];
    netns::in_host(move || {
        commands
            .iter()
            .map(|cmd| {
                let out =
                    Command::new(cmd[0]).args(&cmd[1..]).output().unwrap_or_else(|e| panic!("{}: {e} (install iproute2 and nftables: make test-deps)", cmd[0]));
                let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
                format!("$ {}\n{}", cmd.join(" "), without_lifetimes(&text))
            })
            .collect::<Vec<_>>()
            .join("\n")
    })
    .expect("this binary runs in its own namespace")
}

fn without_lifetimes(text: &str) -> String {
    text.lines()
        .map(|line| {
            let mut out = Vec::new();
            let mut words = line.split_whitespace();
            while let Some(w) = words.next() {
                out.push(w);
                if matches!(w, "valid_lft" | "preferred_lft" | "expires") {
                    words.next();
                }
            }
            out.join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Processes of the world whose binary had pid `owner`, with their command lines.
fn world_processes(owner: u32) -> Vec<(u32, String)> {
    netns::members()
        .into_iter()
        .filter(|&(pid, o)| o as u32 == owner && pid as u32 != owner)
        .filter_map(|(pid, _)| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            Some((pid as u32, String::from_utf8_lossy(&cmdline).replace('\0', " ")))
        })
        .collect()
}

/// A directory named `name` at most `depth` levels under `root`.
fn find_dir(root: &Path, name: &str, depth: usize) -> Option<PathBuf> {
    let entries = std::fs::read_dir(root).ok()?;
    entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).find_map(|e| {
        if e.file_name() == name {
            Some(e.path())
        } else if depth > 0 {
            find_dir(&e.path(), name, depth - 1)
        } else {
            None
        }
    })
}

/// A dev cluster in a child process (its own world), killed and swept however the test ends.
struct World {
    child: Child,
    out: PathBuf,
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        netns::sweep();
        let _ = std::fs::remove_dir_all(&self.out);
    }
}

/// `kubectl` from the host's namespace, through the world's API server relay.
fn kubectl(kubeconfig: &Path, args: &[&str], stdin: &str) -> String {
    let (kubeconfig, args, stdin) = (kubeconfig.to_path_buf(), args.iter().map(|a| a.to_string()).collect::<Vec<_>>(), stdin.to_string());
    netns::in_host(move || {
        let mut child = Command::new(kvgate_testenv::controlplane::kubectl_path())
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl (make controlplane)");
        child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    })
    .unwrap()
}

/// The dev cluster's worker image, pulled from its registry (the mirror of ghcr.io).
const POD: &str = concat!(
    "apiVersion: v1\nkind: Pod\nmetadata: { name: w, labels: { app: w } }\nspec:\n  containers:\n  - name: worker\n    image: ghcr.io/kvgate/kvgate-worker:",
    env!("CARGO_PKG_VERSION"),
    "\n    args: [local, --colocated, --listen=0.0.0.0:8082, --context-window=64, --kv-pool-tokens=256]\n    ports: [{ name: http, containerPort: 8082 }]\n    readinessProbe: { httpGet: { path: /readyz, port: http }, periodSeconds: 1 }\n---\napiVersion: v1\nkind: Service\nmetadata: { name: w }\nspec:\n  selector: { app: w }\n  ports: [{ port: 80, targetPort: http }]\n"
);

#[test]
fn a_world_running_and_a_killed_world_leave_the_hosts_network_as_it_was() {
    let before = host_state();
    let out = std::env::temp_dir().join(format!("kvgate-host-network-{}", std::process::id()));
    // Started from the host's namespace and not part of this binary's world: it makes its own,
    // as `make dev-cluster` does, and its relays listen in the host's namespace.
    std::fs::create_dir_all(&out).unwrap();
    let log = out.join("dev-cluster.log");
    let child = netns::in_host({
        let (out, log) = (out.clone(), std::fs::File::create(&log).unwrap());
        move || {
            Command::new(env!("CARGO_BIN_EXE_kvgate-dev-cluster"))
                .arg("--out")
                .arg(&out)
                .args(["--forward", "default/w"])
                .env_remove(WORLD)
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .process_group(0)
                .spawn()
        }
    })
    .unwrap()
    .unwrap();
    let mut world = World { child, out };
    let owner = world.child.id();
    let kubeconfig = world.out.join("kubeconfig");
    // Up when the kubeconfig appears; a dev cluster that exits first has said why in its log.
    let mut exited = None;
    eventually(
        "the dev cluster's kubeconfig",
        Duration::from_secs(180),
        Duration::from_millis(250),
        || {
            exited = world.child.try_wait().unwrap();
            kubeconfig.is_file() || exited.is_some()
        },
        || format!("its output ({}):\n{}", log.display(), std::fs::read_to_string(&log).unwrap_or_default()),
    );
    assert!(exited.is_none(), "the dev cluster exited ({exited:?}) before it was up:\n{}", std::fs::read_to_string(&log).unwrap_or_default());

    // Its two nodes, Ready, as `kubectl get nodes` shows them through the relay.
    let nodes =
        kubectl(&kubeconfig, &["get", "nodes", "-o", "jsonpath={range .items[*]}{.metadata.name}={.status.conditions[?(@.type==\"Ready\")].status} {end}"], "");
    assert_eq!(nodes.trim(), "node-1=True node-2=True");
    // The host reaches the API server and a Service's pod through 127.0.0.1 only.
    kubectl(&kubeconfig, &["apply", "-f", "-"], POD);
    eventually(
        "the pod Ready",
        Duration::from_secs(60),
        Duration::from_millis(250),
        || kubectl(&kubeconfig, &["get", "pod", "w", "-o", "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}"], "") == "True",
        || kubectl(&kubeconfig, &["get", "pod", "w", "-o", "yaml"], ""),
    );
    let port = std::fs::read_to_string(world.out.join("forward/default.w")).unwrap();
    let health = netns::in_host(move || kvgate_testenv::http::get(&format!("http://127.0.0.1:{}/healthz", port.trim()))).unwrap();
    assert!(health.is_some(), "the Service's pod is not reachable through the relay");
    let running = world_processes(owner);
    assert!(running.iter().any(|(_, cmd)| cmd.contains("kvgate-worker")), "no pod process in the world: {running:?}");
    assert_eq!(host_state(), before, "the host's network changed while a world ran");

    // SIGKILL: no cleanup runs; etcd, the API server, the node agent and the pod outlive it.
    let agent = running.iter().find(|(_, cmd)| cmd.contains("kvgate-node-agent")).map(|(pid, _)| *pid).expect("the node agent");
    world.child.kill().unwrap();
    world.child.wait().unwrap();
    assert!(!world_processes(owner).is_empty(), "nothing was left behind to sweep");

    // What the next run does first: stop the dead world's processes and its node agent's cgroups.
    netns::sweep();
    eventually(
        "the dead world's processes gone",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || world_processes(owner).is_empty(),
        || format!("{:?}", world_processes(owner)),
    );
    drop(kvgate_testenv::node::cgroups::Cgroups::new().expect("cgroups"));
    let left = find_dir(Path::new("/sys/fs/cgroup"), &format!("kvgate-agent-{agent}"), 8);
    assert!(left.is_none(), "{left:?} was not removed");
    drop(world);
    assert_eq!(host_state(), before, "the host's network changed");
}
