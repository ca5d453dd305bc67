//! The node agent: Deployments become OCI containers run by runc (the kvgate images; test tools
//! as host processes), each pod in its own network namespace
//! on a CNI bridge, listed in their Services' EndpointSlices; limits are cgroup limits and a pod
//! over its memory is OOMKilled; readiness gates keep pods NotReady and out of those endpoints;
//! restarts and bad images are reported; RBAC applies to what a pod runs.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use kvgate_testenv::ControlPlane;
use kvgate_testenv::nodes::Node;
use serde_json::Value;

kvgate_testenv::own_network_namespace!();

/// The control plane with one node agent, shared by this file's tests.
static AGENT: OnceLock<Node> = OnceLock::new();

fn cluster() -> &'static ControlPlane {
    let cp = ControlPlane::shared();
    AGENT.get_or_init(|| {
        // The same images pushed to the world's registry (pulled by reference) and pre-loaded.
        kvgate_testenv::images::node_images().unwrap_or_else(|e| panic!("the kvgate images: {e:#}"));
        let dir = kvgate_testenv::images::debug_layouts().unwrap();
        let layout = |image: &str| format!("oci:{}:{}", dir.join("oci").join(image).display(), kvgate_testenv::images::tag());
        let (worker, operator) = (layout("kvgate-worker"), layout("kvgate-operator"));
        let kubectl = kvgate_testenv::controlplane::kubectl_path().display().to_string();
        let python = which("python3").display().to_string();
        // The worker image runs under runc; the tools have no image and run as host processes.
        let images =
            [("kvgate/worker", worker), ("kvgate/operator", operator), ("kvgate/kubectl", kubectl), ("kvgate/python", python)].map(|(n, i)| (n.to_string(), i));
        cp.node_agent(Path::new(env!("CARGO_BIN_EXE_kvgate-node-agent")), "node-1", &images).unwrap_or_else(|e| panic!("node agent: {e:#}"))
    });
    cp
}

fn which(program: &str) -> PathBuf {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join(program))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{program} not found on PATH: install it (make test-deps)"))
}

fn apply(cp: &ControlPlane, ns: &str, yaml: &str) {
    let path = cp.dir.join(format!("{ns}-{}.yaml", yaml.len()));
    std::fs::write(&path, yaml).unwrap();
    cp.kubectl_ok(&["-n", ns, "apply", "-f", path.to_str().unwrap()]);
}

fn json(cp: &ControlPlane, args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.extend(["-o", "json"]);
    serde_json::from_str(&cp.kubectl_ok(&a)).unwrap()
}

fn eventually(cp: &ControlPlane, what: &str, timeout: Duration, check: impl FnMut() -> bool) {
    kvgate_testenv::wait::eventually(what, timeout, Duration::from_millis(250), check, || {
        let pods =
            cp.kubectl(&["get", "pods", "-A", "-o", "custom-columns=NS:.metadata.namespace,NAME:.metadata.name,STATE:.status.containerStatuses[*].state"]);
        let agent = AGENT.get().map(|a| kvgate_testenv::process::tail(a.log(), 40)).unwrap_or_default();
        let containers: String = std::fs::read_dir(cp.node_dir("node-1"))
            .into_iter()
            .flatten()
            .flatten()
            .flat_map(|pod| std::fs::read_dir(pod.path()).into_iter().flatten().flatten())
            .filter(|f| f.path().extension().is_some_and(|e| e == "log"))
            .map(|f| format!("--- {} ---\n{}\n", f.path().display(), kvgate_testenv::process::tail(&f.path(), 10)))
            .collect();
        format!("{}\n--- pods ---\n{}\n--- node agent ---\n{agent}\n{containers}", cp.logs(), String::from_utf8_lossy(&pods.stdout))
    });
}

fn ready(pod: &Value) -> bool {
    pod["status"]["conditions"].as_array().into_iter().flatten().any(|c| c["type"] == "Ready" && c["status"] == "True")
}

/// Addresses of the Service's endpoints, each with whether it is ready.
fn endpoints(cp: &ControlPlane, ns: &str, service: &str) -> Vec<(String, bool)> {
    let slices = json(cp, &["-n", ns, "get", "endpointslices", "-l", &format!("kubernetes.io/service-name={service}")]);
    let mut out: Vec<(String, bool)> = slices["items"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
        .flat_map(|e| {
            let ready = e["conditions"]["ready"] == true;
            e["addresses"].as_array().cloned().unwrap_or_default().into_iter().map(move |a| (a.as_str().unwrap_or("").to_string(), ready))
        })
        .collect();
    out.sort();
    out
}

fn http_ok(ip: &str) -> bool {
    kvgate_testenv::http::get(&format!("http://{ip}:8082/healthz")).is_some()
}

const WORKER: &str = r#"
      containers:
      - name: worker
        image: kvgate/worker:test
        args: ["local", "--colocated", "--listen=0.0.0.0:8082", "--context-window=64", "--kv-pool-tokens=256"]
        ports: [{ name: http, containerPort: 8082 }]
        readinessProbe: { httpGet: { path: /readyz, port: http }, periodSeconds: 1 }
      terminationGracePeriodSeconds: 2
"#;

#[test]
fn two_pods_of_a_deployment_listen_on_the_same_port_each_in_its_own_namespace() {
    let cp = cluster();
    let ns = cp.namespace("agent");
    apply(
        cp,
        &ns,
        &format!(
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{ name: w }}\nspec:\n  replicas: 2\n  selector: {{ matchLabels: {{ app: w }} }}\n  template:\n    metadata: {{ labels: {{ app: w }} }}\n    spec:{WORKER}\n---\n{}",
            service("w")
        ),
    );
    let mut ips = Vec::new();
    eventually(cp, "2 ready worker pods", Duration::from_secs(60), || {
        let pods = json(cp, &["-n", &ns, "get", "pods", "-l", "app=w"]);
        let items = pods["items"].as_array().cloned().unwrap_or_default();
        ips = items.iter().filter(|p| ready(p)).filter_map(|p| p["status"]["podIP"].as_str().map(String::from)).collect();
        ips.len() == 2
    });
    // Both bound 0.0.0.0:8082; each answers on its own pod IP from the CNI bridge's range.
    assert_ne!(ips[0], ips[1]);
    for ip in &ips {
        assert!(ip.starts_with("198.18."), "{ip}");
        assert!(http_ok(ip), "worker on {ip} does not answer");
    }
    // The pod's own localhost is its own (what a real kubelet's port-forward dials).
    let pod = &json(cp, &["-n", &ns, "get", "pods", "-l", "app=w"])["items"][0];
    let link = json_file(&cp.node_dir("node-1").join(pod["metadata"]["uid"].as_str().unwrap()).join("network.json"));
    let inside = std::process::Command::new("nsenter")
        .arg(format!("--net={}", link["netns"].as_str().unwrap()))
        .args(["curl", "-s", "http://127.0.0.1:8082/healthz"])
        .output()
        .unwrap();
    assert!(inside.status.success(), "nothing on the pod's 127.0.0.1:8082: {}", String::from_utf8_lossy(&inside.stderr));
    let mut want: Vec<(String, bool)> = ips.iter().map(|ip| (ip.clone(), true)).collect();
    want.sort();
    eventually(cp, "both pods in the Service's EndpointSlice", Duration::from_secs(30), || endpoints(cp, &ns, "w") == want);
    cp.kubectl_ok(&["-n", &ns, "scale", "deployment", "w", "--replicas=0"]);
    eventually(cp, "both pods gone", Duration::from_secs(30), || json(cp, &["-n", &ns, "get", "pods"])["items"].as_array().is_some_and(|a| a.is_empty()));
    for ip in &ips {
        assert!(!http_ok(ip), "the process on {ip} outlived its pod");
    }
}

fn service(app: &str) -> String {
    format!("apiVersion: v1\nkind: Service\nmetadata: {{ name: {app} }}\nspec:\n  selector: {{ app: {app} }}\n  ports: [{{ port: 8082, targetPort: http }}]\n")
}

fn json_file(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// `kubectl logs` (through the API server and the node agent's kubelet API).
fn container_log(cp: &ControlPlane, ns: &str, pod: &str, container: &str) -> String {
    cp.kubectl_ok(&["-n", ns, "logs", pod, "-c", container])
}

/// A pod running `python3 -c SCRIPT` with the given limits, never restarted.
fn python_pod(name: &str, memory: &str, cpu: &str, script: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{ name: {name} }}\nspec:\n  restartPolicy: Never\n  containers:\n  - name: c\n    image: kvgate/python:test\n    args: [\"-c\", {script:?}]\n    resources: {{ limits: {{ memory: {memory}, cpu: {cpu} }} }}\n"
    )
}

#[test]
fn limits_are_the_pods_cgroup_limits_and_a_pod_over_its_memory_is_oom_killed() {
    let cp = cluster();
    let ns = cp.namespace("limits");
    // The process reads the limits of the cgroup it runs in.
    let show = "import re\nown = dict(l.split(':', 2)[1:] for l in open('/proc/self/cgroup').read().splitlines())\n\
                mem = next(p for c, p in own.items() if 'memory' in c.split(','))\n\
                cpu = next(p for c, p in own.items() if 'cpu' in c.split(','))\n\
                print('memory', open('/sys/fs/cgroup/memory' + mem + '/memory.limit_in_bytes').read().strip())\n\
                print('cpu', open('/sys/fs/cgroup/cpu' + cpu + '/cpu.cfs_quota_us').read().strip())";
    let hog = "b = bytearray(512 * 1024 * 1024)\nprint('allocated', len(b))";
    apply(cp, &ns, &format!("{}---\n{}", python_pod("show", "100Mi", "500m", show), python_pod("hog", "64Mi", "1", hog)));
    eventually(cp, "the limits pod to finish", Duration::from_secs(60), || json(cp, &["-n", &ns, "get", "pod", "show"])["status"]["phase"] == "Succeeded");
    let log = container_log(cp, &ns, "show", "c");
    assert!(log.contains("memory 104857600") && log.contains("cpu 50000"), "{log}");
    eventually(cp, "the memory hog OOMKilled", Duration::from_secs(60), || {
        let t = &json(cp, &["-n", &ns, "get", "pod", "hog"])["status"]["containerStatuses"][0]["state"]["terminated"];
        t["reason"] == "OOMKilled" && t["exitCode"] == 137
    });
    assert_eq!(json(cp, &["-n", &ns, "get", "pod", "hog"])["status"]["phase"], "Failed");
    assert!(!container_log(cp, &ns, "hog", "c").contains("allocated"));
}

#[test]
fn a_memory_fraction_pool_is_sized_from_the_memory_the_pod_is_given() {
    let cp = cluster();
    let ns = cp.namespace("fraction");
    let pod = |name: &str, memory: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{ name: {name} }}\nspec:\n  containers:\n  - name: worker\n    image: kvgate/worker:test\n    args: [\"local\", \"--colocated\", \"--listen=0.0.0.0:8082\", \"--context-window=64\", \"--kv-memory-fraction=0.5\"]\n    resources: {{ limits: {{ memory: {memory} }} }}\n"
        )
    };
    apply(cp, &ns, &format!("{}---\n{}", pod("small", "256Mi"), pod("large", "512Mi")));
    let capacity = |name: &str| -> Option<f64> {
        let ip = json(cp, &["-n", &ns, "get", "pod", name])["status"]["podIP"].as_str()?.to_string();
        let text = kvgate_testenv::http::get(&format!("http://{ip}:8082/metrics"))?;
        kvgate_testenv::metrics::family_sum(&text, "kvgate_kv_pool_capacity_tokens").into()
    };
    let mut sizes = (0.0, 0.0);
    eventually(cp, "both workers serving their pool size", Duration::from_secs(60), || {
        sizes = (capacity("small").unwrap_or(0.0), capacity("large").unwrap_or(0.0));
        sizes.0 > 0.0 && sizes.1 > 0.0
    });
    let (small, large) = sizes;
    // Half of what each limit leaves after the model: the larger limit gives well over the
    // smaller pool, and neither is sized from the host's memory.
    assert!(large > small * 1.5, "pool under 512Mi: {large} tokens, under 256Mi: {small} tokens");
    let bytes_per_token = 512.0; // tiny: 2 layers x K,V x 2 heads x 16 dims x f32
    assert!(large * bytes_per_token <= 0.5 * 512.0 * 1048576.0, "pool of {large} tokens exceeds half of 512Mi");
}

#[test]
fn a_pod_with_an_unmet_readiness_gate_is_never_ready() {
    let cp = cluster();
    let ns = cp.namespace("gate");
    apply(
        cp,
        &ns,
        &format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{ name: gated, labels: {{ app: gated }} }}\nspec:\n      readinessGates: [{{ conditionType: kvgate.dev/kv-pool-verified }}]{WORKER}\n---\n{}",
            service("gated")
        ),
    );
    // The container is ready (its probe passes) but the gate is not: the pod is NotReady.
    eventually(cp, "containers ready", Duration::from_secs(60), || {
        json(cp, &["-n", &ns, "get", "pod", "gated"])["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "ContainersReady" && c["status"] == "True")
    });
    std::thread::sleep(Duration::from_secs(2));
    let pod = json(cp, &["-n", &ns, "get", "pod", "gated"]);
    assert!(!ready(&pod), "{pod}");
    let reason = pod["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Ready").unwrap()["reason"].clone();
    assert_eq!(reason, "ReadinessGatesNotReady", "{}", pod["status"]["conditions"]);
    // The EndpointSlice lists it, but not ready: a Service sends it no traffic.
    let ip = pod["status"]["podIP"].as_str().unwrap().to_string();
    eventually(cp, "the gated pod listed as not ready", Duration::from_secs(30), || endpoints(cp, &ns, "gated") == vec![(ip.clone(), false)]);
    // Setting the gate's condition (as the operator will) makes it Ready, and the node agent
    // keeps the condition it does not own.
    let patch =
        r#"{"status":{"conditions":[{"type":"kvgate.dev/kv-pool-verified","status":"True","reason":"Test","lastTransitionTime":"2026-01-01T00:00:00Z"}]}}"#;
    cp.kubectl_ok(&["-n", &ns, "patch", "pod", "gated", "--subresource=status", "--type=strategic", "-p", patch]);
    eventually(cp, "the gated pod Ready", Duration::from_secs(30), || ready(&json(cp, &["-n", &ns, "get", "pod", "gated"])));
    std::thread::sleep(Duration::from_secs(1));
    let pod = json(cp, &["-n", &ns, "get", "pod", "gated"]);
    assert!(ready(&pod), "the node agent reverted the gate: {pod}");
    eventually(cp, "the gated pod's endpoint ready", Duration::from_secs(30), || endpoints(cp, &ns, "gated") == vec![(ip.clone(), true)]);
}

#[test]
fn exits_are_restarted() {
    let cp = cluster();
    let ns = cp.namespace("restart");
    apply(
        cp,
        &ns,
        "apiVersion: v1\nkind: Pod\nmetadata: { name: crasher }\nspec:\n  containers:\n  - name: c\n    image: kvgate/worker:test\n    args: [\"--no-such-flag\"]\n",
    );
    eventually(cp, "a restart", Duration::from_secs(60), || {
        json(cp, &["-n", &ns, "get", "pod", "crasher"])["status"]["containerStatuses"][0]["restartCount"].as_i64().unwrap_or(0) >= 1
    });
}

fn waiting(cp: &ControlPlane, ns: &str, pod: &str) -> (String, String) {
    let w = &json(cp, &["-n", ns, "get", "pod", pod])["status"]["containerStatuses"][0]["state"]["waiting"];
    (w["reason"].as_str().unwrap_or_default().to_string(), w["message"].as_str().unwrap_or_default().to_string())
}

/// Images not pre-loaded are pulled by reference from the registry they name, as a kubelet's
/// runtime pulls them: the world's registry by its address, and ghcr.io through the mirror the
/// agent was given. One the registry lacks waits in ErrImagePull / ImagePullBackOff with the
/// registry's answer, and runs once it is pushed, with no change to the pod.
#[test]
fn images_are_pulled_by_reference_and_a_missing_one_backs_off_until_it_is_pushed() {
    let cp = cluster();
    let ns = cp.namespace("pull");
    let (host, tag) = (kvgate_testenv::registry::host(), kvgate_testenv::images::tag());
    let missing = format!("pulled-late-{}", std::process::id());
    let pod = |name: &str, image: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{ name: {name} }}\nspec:\n  restartPolicy: Never\n  containers:\n  - name: c\n    image: {image}\n    args: [--version]\n"
        )
    };
    apply(cp, &ns, &pod("direct", &format!("{host}/kvgate/kvgate-operator:{tag}")));
    apply(cp, &ns, &pod("mirrored", &format!("ghcr.io/kvgate/kvgate-operator:{tag}")));
    apply(cp, &ns, &pod("late", &format!("{host}/kvgate/kvgate-operator:{missing}")));
    for (name, repository) in [("direct", format!("{host}/kvgate/kvgate-operator")), ("mirrored", "ghcr.io/kvgate/kvgate-operator".to_string())] {
        eventually(cp, &format!("{name}: the pulled operator image printing its version"), Duration::from_secs(60), || {
            json(cp, &["-n", &ns, "get", "pod", name])["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
        });
        assert_eq!(container_log(cp, &ns, name, "c").trim(), format!("kvgate-operator {tag}"));
        let id = json(cp, &["-n", &ns, "get", "pod", name])["status"]["containerStatuses"][0]["imageID"].as_str().unwrap().to_string();
        assert!(id.starts_with(&format!("{repository}@sha256:")), "{name}: imageID {id}");
    }
    eventually(cp, "ErrImagePull naming the registry's answer", Duration::from_secs(30), || {
        let (reason, message) = waiting(cp, &ns, "late");
        reason == "ErrImagePull"
            && message.contains(&format!("Failed to pull image \"{host}/kvgate/kvgate-operator:{missing}\""))
            && message.contains("manifest unknown")
    });
    eventually(cp, "ImagePullBackOff between tries", Duration::from_secs(30), || {
        let (reason, message) = waiting(cp, &ns, "late");
        reason == "ImagePullBackOff" && message.starts_with("Back-off pulling image") && message.contains("manifest unknown")
    });
    let dir = kvgate_testenv::images::debug_layouts().unwrap();
    kvgate_testenv::registry::shared().unwrap().push_tag(&dir.join("oci/kvgate-operator"), tag, "kvgate-operator", &missing).unwrap();
    eventually(cp, "the late image pulled once pushed, and run", Duration::from_secs(90), || {
        json(cp, &["-n", &ns, "get", "pod", "late"])["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    });
}

#[test]
fn a_process_runs_with_its_service_accounts_permissions() {
    let cp = cluster();
    let ns = cp.namespace("sa");
    apply(
        cp,
        &ns,
        "apiVersion: v1\nkind: ServiceAccount\nmetadata: { name: limited }\n---\napiVersion: v1\nkind: Pod\nmetadata: { name: lister }\nspec:\n  serviceAccountName: limited\n  restartPolicy: Never\n  containers:\n  - name: c\n    image: kvgate/kubectl:test\n    args: [\"get\", \"pods\"]\n",
    );
    eventually(cp, "the pod to fail", Duration::from_secs(60), || json(cp, &["-n", &ns, "get", "pod", "lister"])["status"]["phase"] == "Failed");
    let pod = json(cp, &["-n", &ns, "get", "pod", "lister"]);
    let uid = pod["metadata"]["uid"].as_str().unwrap();
    let log = std::fs::read_to_string(cp.dir.join("node-1").join(uid).join("c.log")).unwrap();
    assert!(log.contains("Forbidden") && log.contains(&format!("system:serviceaccount:{ns}:limited")), "{log}");
}

/// The pod's processes: those whose working directory is the pod's directory on the node.
/// The pid of a pod's container, as runc (under the node agent's `--root`) reports it.
fn container_pid(cp: &ControlPlane, ns: &str, pod: &str, container: &str) -> i32 {
    let uid = json(cp, &["-n", ns, "get", "pod", pod])["metadata"]["uid"].as_str().unwrap().to_string();
    let runc = |args: &[&str]| {
        let out = std::process::Command::new("runc").arg("--root").arg(cp.node_dir("node-1").join("runc")).args(args).output().unwrap();
        assert!(out.status.success(), "runc {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    };
    // Container IDs are `kvgate-ctr-<agent pid>-<pod uid>-<container>` (node::cgroups::container_name).
    let suffix = format!("-{uid}-{container}");
    let list = runc(&["list", "--format", "json"]);
    let id = list
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["id"].as_str())
        .find(|id| id.ends_with(&suffix))
        .unwrap_or_else(|| panic!("no runc container for {suffix}: {list}"))
        .to_string();
    let state = runc(&["state", &id]);
    assert_eq!(state["status"], "running", "{state}");
    state["pid"].as_i64().unwrap() as i32
}

#[test]
fn kubectl_logs_shows_follows_and_keeps_the_previous_run_of_a_worker() {
    let cp = cluster();
    let ns = cp.namespace("logs");
    apply(cp, &ns, &format!("apiVersion: v1\nkind: Pod\nmetadata: {{ name: w, labels: {{ app: w }} }}\nspec:{WORKER}"));
    eventually(cp, "the worker ready", Duration::from_secs(60), || ready(&json(cp, &["-n", &ns, "get", "pod", "w"])));
    let listening = "kvgate-worker local listening on http://0.0.0.0:8082";
    assert!(container_log(cp, &ns, "w", "worker").contains(listening));

    // The kubelet API (on the node's address) answers only the API server's client certificate.
    let port = json(cp, &["get", "node", "node-1"])["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"].as_u64().unwrap();
    let curl = |cert: &Path, key: &Path| {
        std::process::Command::new("curl")
            .args(["-sS", "--fail-with-body", "--cacert", cp.certs.ca.to_str().unwrap(), "--cert", cert.to_str().unwrap(), "--key", key.to_str().unwrap()])
            .arg(format!("https://{}:{port}/containerLogs/{ns}/w/worker", AGENT.get().unwrap().machine.ip))
            .output()
            .unwrap()
    };
    let direct = curl(&cp.certs.kubelet_client_cert, &cp.certs.kubelet_client_key);
    assert!(String::from_utf8_lossy(&direct.stdout).contains(listening), "{direct:?}");
    let admin = curl(&cp.certs.admin_cert, &cp.certs.admin_key);
    assert!(!admin.status.success() && !String::from_utf8_lossy(&admin.stdout).contains(listening), "the admin's certificate read logs: {admin:?}");

    // Before any restart there is no previous run: the kubelet's error, through the API server.
    let out = cp.kubectl(&["-n", &ns, "logs", "w", "--previous"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("previous terminated container \"worker\" in pod \"w\" not found"), "{err}");
    // Options that need timestamps are refused by name, not ignored.
    let out = cp.kubectl(&["-n", &ns, "logs", "w", "--timestamps"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("timestamps is not supported"));

    // `kubectl logs -f` streams until the container exits: SIGTERM makes the worker log its
    // shutdown and exit 0, and the stream ends with that line.
    let mut follow = std::process::Command::new(kvgate_testenv::controlplane::kubectl_path())
        .args(["--kubeconfig", cp.kubeconfig.to_str().unwrap(), "-n", &ns, "logs", "-f", "w"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(follow.stdout.take().unwrap());
    // The start-up lines before it (the CPU kernels chosen, ...) come first.
    let mut seen = String::new();
    while !seen.lines().any(|l| l.contains(listening)) {
        let before = seen.len();
        std::io::BufRead::read_line(&mut stdout, &mut seen).unwrap();
        assert!(seen.len() > before && seen.lines().count() <= 20, "no `{listening}` line in what `kubectl logs -f` streamed: {seen}");
    }
    let pid = container_pid(cp, &ns, "w", "worker");
    // SAFETY: signalling the pod's own worker process.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut rest);
        let _ = tx.send(rest);
    });
    let rest = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|_| {
        let _ = follow.kill();
        panic!("kubectl logs -f still streaming 30 s after the container exited\n{}", cp.logs())
    });
    assert!(follow.wait().unwrap().success());
    assert!(rest.contains("shutting down"), "the followed stream ended without the exit's line: {rest}");

    // The restarted container logs afresh; its previous run keeps the shutdown.
    eventually(cp, "the worker restarted and ready", Duration::from_secs(60), || {
        let pod = json(cp, &["-n", &ns, "get", "pod", "w"]);
        pod["status"]["containerStatuses"][0]["restartCount"] == 1 && ready(&pod)
    });
    let current = container_log(cp, &ns, "w", "worker");
    assert!(current.contains(listening) && !current.contains("shutting down"), "{current}");
    let previous = cp.kubectl_ok(&["-n", &ns, "logs", "w", "--previous"]);
    assert!(previous.contains(listening) && previous.contains("shutting down"), "{previous}");
    let last = cp.kubectl_ok(&["-n", &ns, "logs", "w", "--previous", "--tail=1"]);
    assert_eq!(last.lines().count(), 1, "{last}");
    assert!(last.contains("shutting down"), "{last}");
    let limited = cp.kubectl_ok(&["-n", &ns, "logs", "w", "--limit-bytes=10"]);
    assert_eq!(limited, current[..10], "--limit-bytes: the log's first 10 bytes");
}

/// A field of `/proc/PID/status` (e.g. `Uid`, `CapEff`).
fn proc_status(pid: i32, field: &str) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    text.lines().find_map(|l| l.strip_prefix(&format!("{field}:"))).unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status")).trim().to_string()
}

#[test]
fn the_images_run_under_runc_as_nonroot_on_a_read_only_root_with_no_capabilities() {
    let cp = cluster();
    let ns = cp.restricted_namespace("image");
    // The restricted profile, as the operator renders its pods; /tmp is an emptyDir.
    let security = "securityContext: { allowPrivilegeEscalation: false, readOnlyRootFilesystem: true, capabilities: { drop: [ALL] } }";
    apply(
        cp,
        &ns,
        &format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{ name: w }}\nspec:\n  securityContext: {{ runAsNonRoot: true, seccompProfile: {{ type: RuntimeDefault }} }}\n  volumes: [{{ name: tmp, emptyDir: {{}} }}]\n  containers:\n  - name: worker\n    image: kvgate/worker:test\n    args: [local, --colocated, --listen=0.0.0.0:8082, --context-window=64, --kv-pool-tokens=256]\n    volumeMounts: [{{ name: tmp, mountPath: /tmp }}]\n    {security}\n---\napiVersion: v1\nkind: Pod\nmetadata: {{ name: op }}\nspec:\n  restartPolicy: Never\n  securityContext: {{ runAsNonRoot: true, seccompProfile: {{ type: RuntimeDefault }} }}\n  containers:\n  - name: operator\n    image: kvgate/operator:test\n    args: [--version]\n    {security}\n"
        ),
    );
    let mut ip = String::new();
    eventually(cp, "the worker serving /healthz", Duration::from_secs(60), || {
        ip = json(cp, &["-n", &ns, "get", "pod", "w"])["status"]["podIP"].as_str().unwrap_or_default().to_string();
        !ip.is_empty() && http_ok(&ip)
    });
    let pod = json(cp, &["-n", &ns, "get", "pod", "w"]);
    assert!(pod["status"]["containerStatuses"][0]["imageID"].as_str().unwrap().contains("@sha256:"), "{pod}");
    let pid = container_pid(cp, &ns, "w", "worker");
    assert_eq!(proc_status(pid, "Uid"), "65532\t65532\t65532\t65532");
    assert_eq!(proc_status(pid, "Gid"), "65532\t65532\t65532\t65532");
    for caps in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(proc_status(pid, caps), "0000000000000000", "{caps}");
    }
    assert_eq!(proc_status(pid, "NoNewPrivs"), "1");
    assert_eq!(proc_status(pid, "Seccomp"), "2", "seccompProfile RuntimeDefault: a filter is installed");
    // The container's root (mount point "/" in its own mount namespace) is read-only; /tmp is not.
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    let options = |point: &str| mounts.lines().map(|l| l.split(' ').collect::<Vec<_>>()).filter(|f| f[4] == point).map(|f| f[5].to_string()).next_back();
    assert!(options("/").is_some_and(|o| o.split(',').any(|x| x == "ro")), "root not read-only:\n{mounts}");
    assert!(options("/tmp").is_some_and(|o| o.split(',').any(|x| x == "rw")), "/tmp not writable:\n{mounts}");
    // Its own pid namespace: the worker is pid 1 there.
    assert_eq!(proc_status(pid, "NSpid").split_whitespace().last(), Some("1"));

    eventually(cp, "the operator image printing its version", Duration::from_secs(60), || {
        json(cp, &["-n", &ns, "get", "pod", "op"])["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    });
    let version = container_log(cp, &ns, "op", "operator");
    assert_eq!(version.trim(), format!("kvgate-operator {}", env!("CARGO_PKG_VERSION")));
}

/// `(mount point, filesystem type, super options)` of each mount in a mountinfo text.
fn mount_table(mountinfo: &str) -> Vec<(String, String, String)> {
    mountinfo
        .lines()
        .filter_map(|l| {
            let (own, fs) = l.split_once(" - ")?;
            let point = own.split(' ').nth(4)?.to_string();
            let mut fs = fs.split(' ');
            Some((point, fs.next()?.to_string(), fs.nth(1)?.to_string()))
        })
        .collect()
}

#[test]
fn a_writable_root_is_an_overlay_of_the_image_in_the_agents_own_mounts_and_goes_with_its_pod() {
    let cp = cluster();
    let ns = cp.namespace("rootfs");
    let pod = format!("apiVersion: v1\nkind: Pod\nmetadata: {{ name: w }}\nspec:{WORKER}");
    apply(cp, &ns, &pod);
    let serving = |cp: &ControlPlane| {
        let ip = json(cp, &["-n", &ns, "get", "pod", "w"])["status"]["podIP"].as_str().unwrap_or_default().to_string();
        !ip.is_empty() && http_ok(&ip)
    };
    eventually(cp, "the worker serving from a writable root", Duration::from_secs(60), || serving(cp));
    let uid = json(cp, &["-n", &ns, "get", "pod", "w"])["metadata"]["uid"].as_str().unwrap().to_string();
    let bundle = cp.node_dir("node-1").join(&uid).join("bundles/worker");
    let root = bundle.join("rootfs").display().to_string();

    // The container's "/" is an overlay whose upper layer is its bundle's, not a copy.
    let pid = container_pid(cp, &ns, "w", "worker");
    let inside = mount_table(&std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap());
    let (_, fs, options) = inside.iter().rfind(|(point, ..)| point == "/").expect("a root mount");
    assert_eq!(fs, "overlay", "{inside:?}");
    assert!(options.contains(&format!("upperdir={}", bundle.join("upper").display())), "{options}");
    // Mounted in the agent's namespace only: the host's has no trace of it.
    let agent = AGENT.get().unwrap().agent_pid();
    let agents = || mount_table(&std::fs::read_to_string(format!("/proc/{agent}/mountinfo")).unwrap());
    assert!(agents().iter().any(|(point, fs, _)| *point == root && fs == "overlay"), "{:?}", agents());
    let host = mount_table(&std::fs::read_to_string("/proc/self/mountinfo").unwrap());
    assert!(host.iter().all(|(point, ..)| !point.contains("/bundles/")), "{host:?}");

    // The pod goes: its overlay is unmounted and its bundle removed.
    cp.kubectl_ok(&["-n", &ns, "delete", "pod", "w", "--wait=true"]);
    eventually(cp, "the overlay unmounted and the bundle removed", Duration::from_secs(30), || {
        agents().iter().all(|(point, ..)| *point != root) && !bundle.exists()
    });
    // Created again: a new pod, a new overlay, serving.
    apply(cp, &ns, &pod);
    eventually(cp, "the re-created worker serving", Duration::from_secs(60), || serving(cp));
    let uid = json(cp, &["-n", &ns, "get", "pod", "w"])["metadata"]["uid"].as_str().unwrap().to_string();
    let root = cp.node_dir("node-1").join(&uid).join("bundles/worker/rootfs").display().to_string();
    assert!(agents().iter().any(|(point, fs, _)| *point == root && fs == "overlay"), "{:?}", agents());
}

/// An HTTP/1.1 exchange over a fresh connection to `addr`: the status and the body's bytes, or
/// `None` when the connection closed without an answer.
fn exchange(addr: std::net::SocketAddr, method: &str, body: &[u8]) -> Option<(u16, Vec<u8>)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    write!(s, "{method} / HTTP/1.1\r\nHost: pod\r\nConnection: close\r\nContent-Length: {}\r\n\r\n", body.len()).ok()?;
    s.write_all(body).ok()?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).ok()?;
    let split = out.windows(4).position(|w| w == b"\r\n\r\n")?;
    let status = std::str::from_utf8(&out[..split]).ok()?.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, out[split + 4..].to_vec()))
}

/// A server on the pod's loopback only (what a port-forward reaches and a Service cannot):
/// GET answers 1 MiB of a known pattern, POST answers its body reversed.
const LOOPBACK_SERVER: &str = r#"
import http.server
BIG = bytes(i % 251 for i in range(1 << 20))
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def answer(self, body):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self.answer(BIG)
    def do_POST(self):
        self.answer(self.rfile.read(int(self.headers["Content-Length"]))[::-1])
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", 8000), H).serve_forever()
"#;

/// `kubectl port-forward` through the API server to the node agent, as to a kubelet: a port on
/// the pod's own loopback, a megabyte each way in many SPDY frames, connections side by side,
/// and a port nothing listens on reported by kubectl with the node's reason.
#[test]
fn kubectl_port_forward_reaches_a_pods_loopback_both_ways() {
    let cp = cluster();
    let ns = cp.namespace("forward");
    apply(cp, &ns, &python_pod("pf", "256Mi", "1", LOOPBACK_SERVER));
    eventually(cp, "the pod running", Duration::from_secs(60), || json(cp, &["-n", &ns, "get", "pod", "pf"])["status"]["phase"] == "Running");
    // Until the server listens, a forwarded connection fails and kubectl exits ("lost
    // connection to pod"), as it does against a kubelet: each try starts a port-forward.
    let (mut forward, mut answer) = (None, None);
    eventually(cp, "a GET through a kubectl port-forward", Duration::from_secs(60), || {
        let Ok(f) = cp.port_forward(&ns, "pod/pf", 8000) else { return false };
        answer = exchange(f.local, "GET", b"");
        forward = Some(f);
        answer.is_some()
    });
    let forward = forward.unwrap();
    let big: Vec<u8> = (0..1usize << 20).map(|i| (i % 251) as u8).collect();
    assert_eq!(answer.map(|(s, b)| (s, b.len(), b == big)), Some((200, big.len(), true)), "kubectl said: {}", forward.stderr());
    let upload: Vec<u8> = (0..300_000usize).map(|i| (i * 7 % 256) as u8).collect();
    let (status, echoed) = exchange(forward.local, "POST", &upload).unwrap();
    assert_eq!(status, 200);
    assert!(echoed.iter().eq(upload.iter().rev()), "the upload came back reversed, whole ({} of {} bytes)", echoed.len(), upload.len());
    let side_by_side: Vec<_> = (0..4).map(|_| std::thread::spawn(move || exchange(forward.local, "GET", b"").map(|(s, b)| (s, b.len())))).collect();
    for t in side_by_side {
        assert_eq!(t.join().unwrap(), Some((200, 1 << 20)));
    }
    let closed = cp.port_forward(&ns, "pod/pf", 9999).unwrap();
    assert_eq!(exchange(closed.local, "GET", b""), None, "nothing listens on 9999");
    eventually(cp, "kubectl printing the node's reason", Duration::from_secs(10), || closed.stderr().contains("failed to connect to localhost:9999"));
    assert!(closed.stderr().contains("Connection refused"), "{}", closed.stderr());
}
