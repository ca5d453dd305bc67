//! A control plane, a node agent that runs the kvgate images (built from the debug binaries) as
//! OCI containers under runc,
//! and the operator as a real process: what every end-to-end test starts from.

#![allow(dead_code)]

pub mod schemas;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvgate_testenv::ControlPlane;
#[allow(unused_imports)] // not every test binary sends headers
pub use kvgate_testenv::http::{get, request, request_with};
use kvgate_testenv::process::{Proc, free_port, tail};
use serde_json::Value;

// Every test binary that uses this module runs in a network namespace of its own.
kvgate_testenv::own_network_namespace!();

pub fn workspace_bin(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug").join(name);
    assert!(p.is_file(), "{} not found: build it with `cargo build --workspace` (make test does)", p.display());
    p
}

/// `kubectl kvgate ARGS` through the real kubectl, which finds the plugin on PATH as a user's
/// does (KUBECONFIG from the environment: kubectl refuses flags before a plugin's name): its
/// exit code, and stdout then stderr.
pub fn kubectl_kvgate(cp: &ControlPlane, args: &[&str]) -> (i32, String) {
    let plugin = Path::new(env!("CARGO_BIN_EXE_kubectl-kvgate"));
    let path = format!("{}:{}", plugin.parent().unwrap().display(), std::env::var("PATH").unwrap_or_default());
    let out = std::process::Command::new(kvgate_testenv::controlplane::kubectl_path())
        .arg("kvgate")
        .args(args)
        .env("KUBECONFIG", &cp.kubeconfig)
        .env("PATH", path)
        .output()
        .expect("kubectl not found: build it with `make controlplane`");
    (out.status.code().unwrap_or(-1), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// `kubectl kvgate why NAME` in `ns` exits `code` and says each of `wants`.
pub fn why_says<S: AsRef<str>>(cp: &ControlPlane, ns: &str, name: &str, code: i32, wants: &[S]) {
    let (got, why) = kubectl_kvgate(cp, &["why", name, "-n", ns]);
    assert_eq!(got, code, "kubectl kvgate why {name} exits {got}:\n{why}");
    for want in wants {
        assert!(why.contains(want.as_ref()), "kubectl kvgate why {name} does not say {:?}:\n{why}", want.as_ref());
    }
}

pub fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

/// The operator, run as a process with the admin kubeconfig.
pub struct Operator {
    pub proc: Proc,
    pub metrics: String,
}

impl Operator {
    pub fn start(cp: &ControlPlane, name: &str) -> Operator {
        Self::start_in(cp, name, "kvgate-operator", None)
    }

    /// An operator watching only `namespace` (tests that run operators side by side); replicas
    /// started with the same `lease` elect one leader among them.
    pub fn start_in(cp: &ControlPlane, name: &str, lease: &str, namespace: Option<&str>) -> Operator {
        Self::start_with(cp, name, lease, namespace, &[])
    }

    /// As `start_in`, with more arguments (`--log-format=json` before `run` is global too).
    pub fn start_with(cp: &ControlPlane, name: &str, lease: &str, namespace: Option<&str>, extra: &[&str]) -> Operator {
        Self::start_with_env(cp, name, lease, namespace, extra, &[])
    }

    /// As `start_with`, with environment variables set for the operator (`NAME=value`), e.g.
    /// the OTLP endpoint of its own spans.
    pub fn start_with_env(cp: &ControlPlane, name: &str, lease: &str, namespace: Option<&str>, extra: &[&str], env: &[&str]) -> Operator {
        let port = free_port();
        let mut args = vec![
            "run".to_string(),
            format!("--kubeconfig={}", cp.kubeconfig.display()),
            format!("--metrics-addr=127.0.0.1:{port}"),
            "--leader-elect".to_string(),
            format!("--identity={name}"),
            "--lease-namespace=default".to_string(),
            format!("--lease-name={lease}"),
        ];
        args.extend(namespace.map(|ns| format!("--namespace={ns}")));
        args.extend(extra.iter().map(|a| a.to_string()));
        let bin = Path::new(env!("CARGO_BIN_EXE_kvgate-operator"));
        let mut proc = if env.is_empty() {
            Proc::spawn(name, bin, &args, &cp.dir).unwrap()
        } else {
            let with_env: Vec<String> = env.iter().map(|e| e.to_string()).chain([bin.display().to_string()]).chain(args).collect();
            Proc::spawn(name, Path::new("/usr/bin/env"), &with_env, &cp.dir).unwrap()
        };
        let metrics = format!("http://127.0.0.1:{port}/metrics");
        let deadline = Instant::now() + Duration::from_secs(30);
        while get(&metrics).is_none() {
            proc.check_alive().unwrap_or_else(|e| panic!("{e:#}"));
            assert!(Instant::now() < deadline, "the operator did not serve /metrics:\n{}", tail(&proc.log, 40));
            std::thread::sleep(Duration::from_millis(100));
        }
        Operator { proc, metrics }
    }

    /// The value of one sample of the operator's /metrics (`name{labels}` as printed).
    pub fn metric(&self, sample: &str) -> Option<f64> {
        kvgate_testenv::metrics::sample(&get(&self.metrics)?, sample)
    }

    /// The operator's /metrics lines whose labels name this deployment.
    pub fn series_of(&self, ns: &str, name: &str) -> Vec<String> {
        let text = get(&self.metrics).unwrap_or_default();
        text.lines()
            .filter(|l| !l.starts_with('#') && l.contains(&format!("name=\"{name}\"")) && l.contains(&format!("namespace=\"{ns}\"")))
            .map(String::from)
            .collect()
    }
}

/// Installs the CRDs from `crds/` and starts a node agent mapping the worker image.
pub fn cluster() -> &'static ControlPlane {
    node_1();
    ControlPlane::shared()
}

/// The cluster's one node (most tests need no more; `nodes.rs` starts its own world of two).
pub fn node_1() -> &'static kvgate_testenv::nodes::Node {
    use std::sync::OnceLock;
    static NODE: OnceLock<kvgate_testenv::nodes::Node> = OnceLock::new();
    let cp = ControlPlane::shared();
    NODE.get_or_init(|| {
        cp.kubectl_ok(&["apply", "-f", repo("crds").to_str().unwrap()]);
        cp.kubectl_ok(&["wait", "--for=condition=Established", "crd/inferencedeployments.kvgate.dev", "--timeout=30s"]);
        let images = kvgate_testenv::images::node_images().unwrap_or_else(|e| panic!("the kvgate images: {e:#}"));
        cp.node_agent(&workspace_bin("kvgate-node-agent"), "node-1", &images).unwrap_or_else(|e| panic!("node agent: {e:#}"))
    })
}

/// A fresh file under the control plane's directory for one manifest.
fn manifest(cp: &ControlPlane, ns: &str, yaml: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let path = cp.dir.join(format!("{ns}-{}.yaml", N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)));
    std::fs::write(&path, yaml).unwrap();
    path
}

pub fn apply_yaml(cp: &ControlPlane, ns: &str, yaml: &str) {
    cp.kubectl_ok(&["-n", ns, "apply", "-f", manifest(cp, ns, yaml).to_str().unwrap()]);
}

/// `kubectl apply` that may fail: (success, stderr).
pub fn try_apply(cp: &ControlPlane, ns: &str, yaml: &str) -> (bool, String) {
    let out = cp.kubectl(&["-n", ns, "apply", "-f", manifest(cp, ns, yaml).to_str().unwrap()]);
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

pub fn get_json(cp: &ControlPlane, args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.extend(["-o", "json"]);
    let out = cp.kubectl(&a);
    if !out.status.success() {
        return Value::Null;
    }
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

pub fn condition<'a>(obj: &'a Value, type_: &str) -> Option<&'a Value> {
    obj["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == type_)
}

pub fn condition_true(obj: &Value, type_: &str) -> bool {
    condition(obj, type_).is_some_and(|c| c["status"] == "True")
}

/// Waits for `check`, or fails with what the namespace looks like.
pub fn eventually(cp: &ControlPlane, ns: &str, what: &str, timeout: Duration, check: impl FnMut() -> bool) {
    kvgate_testenv::wait::eventually(what, timeout, Duration::from_millis(300), check, || diagnostics(cp, ns));
}

/// Objects, events and pod logs of a namespace, and the components' logs.
pub fn diagnostics(cp: &ControlPlane, ns: &str) -> String {
    let k = |args: &[&str]| {
        let out = cp.kubectl(args);
        format!("$ kubectl {}\n{}{}", args.join(" "), String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    };
    let mut out = vec![
        k(&["-n", ns, "get", "infd,deploy,pods,endpointslices", "-o", "wide"]),
        k(&["-n", ns, "get", "infd", "-o", "yaml"]),
        k(&["-n", ns, "get", "events", "--sort-by=.lastTimestamp"]),
    ];
    let pods = get_json(cp, &["-n", ns, "get", "pods"]);
    let dirs = pod_dirs(cp);
    let mut shown = std::collections::BTreeSet::new();
    for p in pods["items"].as_array().into_iter().flatten() {
        let uid = p["metadata"]["uid"].as_str().unwrap_or("").to_string();
        out.push(format!("--- pod {} ---\n{}\n{}", p["metadata"]["name"], p["status"]["conditions"], container_logs(&dirs, &uid, 15)));
        shown.insert(uid);
    }
    // Pods already deleted (a refused revision's are scaled away at once) keep their logs in the
    // node agents' pod directories: every one written to since the namespace was created.
    let created =
        get_json(cp, &["get", "namespace", ns])["metadata"]["creationTimestamp"].as_str().and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok());
    let since = created.map_or(std::time::SystemTime::UNIX_EPOCH, std::time::SystemTime::from);
    for (uid, dir) in &dirs {
        let recent = std::fs::read_dir(dir).into_iter().flatten().flatten().any(|e| e.metadata().and_then(|m| m.modified()).is_ok_and(|t| t >= since));
        if recent && !shown.contains(uid) {
            out.push(format!("--- deleted pod {uid} ({}) ---\n{}", dir.display(), container_logs(&dirs, uid, 60)));
        }
    }
    out.push(cp.logs());
    for entry in std::fs::read_dir(&cp.dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("operator") && name.ends_with(".log") {
            out.push(format!("--- {name} ---\n{}", tail(&entry.path(), 40)));
        }
    }
    out.join("\n")
}

/// Every pod directory of every node agent (named by the pod's UID, beside the agent's own
/// `images` and `ipam`), by pod UID.
fn pod_dirs(cp: &ControlPlane) -> Vec<(String, PathBuf)> {
    let nodes = std::fs::read_dir(&cp.dir).into_iter().flatten().flatten().filter(|e| e.file_name().to_string_lossy().starts_with("node-"));
    let entries = nodes.flat_map(|n| std::fs::read_dir(n.path()).into_iter().flatten().flatten());
    let uid = |name: &str| name.len() == 36 && name.matches('-').count() == 4;
    entries.map(|e| (e.file_name().to_string_lossy().into_owned(), e.path())).filter(|(name, _)| uid(name)).collect()
}

/// The last `lines` of each container log (`CONTAINER.log`, `CONTAINER.previous.log`) of pod
/// `uid`, in whichever of the node agents' pod directories `dirs` holds it.
fn container_logs(dirs: &[(String, PathBuf)], uid: &str, lines: usize) -> String {
    let mut out = Vec::new();
    for (_, dir) in dirs.iter().filter(|(u, _)| u == uid) {
        let mut logs: Vec<PathBuf> =
            std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "log")).collect();
        logs.sort();
        for log in logs {
            out.push(format!("[{}]\n{}", log.file_name().unwrap_or_default().to_string_lossy(), tail(&log, lines)));
        }
    }
    out.join("\n")
}

/// The router pods' addresses, from the API Service's EndpointSlices (ready ones).
pub fn router_endpoints(cp: &ControlPlane, ns: &str, name: &str) -> Vec<String> {
    let slices = get_json(cp, &["-n", ns, "get", "endpointslices", "-l", &format!("kubernetes.io/service-name={name}")]);
    slices["items"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
        .filter(|e| e["conditions"]["ready"] == true)
        .flat_map(|e| e["addresses"].as_array().cloned().unwrap_or_default())
        .filter_map(|a| a.as_str().map(|a| format!("{a}:8080")))
        .collect()
}

/// A ready router's address, once the API Service lists one (its readiness follows its peers').
pub fn ready_router(cp: &ControlPlane, ns: &str, name: &str, timeout: Duration) -> String {
    let mut router = None;
    eventually(cp, ns, &format!("a ready router endpoint of {name}"), timeout, || {
        router = router_endpoints(cp, ns, name).pop();
        router.is_some()
    });
    router.unwrap()
}

/// `ip:port` of a Service's ready endpoints on its first port (the engine's own port).
pub fn service_endpoints(cp: &ControlPlane, ns: &str, name: &str) -> Vec<String> {
    let slices = get_json(cp, &["-n", ns, "get", "endpointslices", "-l", &format!("kubernetes.io/service-name={name}")]);
    let mut out = Vec::new();
    for s in slices["items"].as_array().into_iter().flatten() {
        let Some(port) = s["ports"][0]["port"].as_u64() else { continue };
        for e in s["endpoints"].as_array().into_iter().flatten().filter(|e| e["conditions"]["ready"] == true) {
            out.extend(e["addresses"].as_array().into_iter().flatten().filter_map(|a| a.as_str()).map(|a| format!("{a}:{port}")));
        }
    }
    out
}

/// A completion through the router: (status, body).
pub fn complete(router: &str, prompt: &str, max_tokens: u32) -> Option<(u16, String)> {
    let body = serde_json::json!({ "prompt": prompt, "max_tokens": max_tokens, "temperature": 0 }).to_string();
    request("POST", &format!("http://{router}/v1/completions"), Some(&body))
}

/// The generated text of a completion's JSON body.
pub fn completion_text(body: &str) -> Option<String> {
    serde_json::from_str::<Value>(body).ok()?["choices"][0]["text"].as_str().map(String::from)
}

/// An InferenceDeployment manifest (as `tiny` writes it) whose workers run `image`.
pub fn with_image(yaml: &str, image: &str) -> String {
    yaml.replace("spec:\n", &format!("spec:\n  image: {image}\n"))
}

/// The InferenceDeployment as JSON.
pub fn infd(cp: &ControlPlane, ns: &str, name: &str) -> Value {
    get_json(cp, &["-n", ns, "get", "infd", name])
}

/// An InferenceDeployment of the tiny model with the given window and pools.
pub fn tiny(name: &str, window: u64, prefill_tokens: u64, decode_tokens: u64, extra: &str) -> String {
    format!(
        "apiVersion: kvgate.dev/v1alpha1\nkind: InferenceDeployment\nmetadata: {{ name: {name} }}\nspec:\n  model: {{ name: tiny }}\n  contextWindow: {window}\n  prefill:\n    replicas: 1\n    kvPool: {{ tokens: {prefill_tokens}{extra} }}\n  decode:\n    replicas: 1\n    kvPool: {{ tokens: {decode_tokens} }}\n"
    )
}

/// How many times Events of `reason` were published in `ns` (series counted).
pub fn events(cp: &ControlPlane, ns: &str, reason: &str) -> i64 {
    let evs = get_json(cp, &["-n", ns, "get", "events", &format!("--field-selector=reason={reason}")]);
    evs["items"].as_array().into_iter().flatten().map(|e| e["series"]["count"].as_i64().unwrap_or(e["count"].as_i64().unwrap_or(1))).sum()
}

/// Clients sending one greedy prompt through a deployment's API Service until stopped, as
/// kube-proxy would route them: every request goes to one of the Service's ready endpoints as
/// last seen (refreshed every half second, round robin), never retried.
pub struct Traffic {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    clients: Vec<std::thread::JoinHandle<Vec<Attempt>>>,
    endpoints: std::thread::JoinHandle<()>,
}

/// When a request was sent and what came back (`None`: no router could be reached).
pub type Attempt = (Instant, Option<(u16, String)>);

/// What the clients of a [`Traffic`] got.
pub struct Outcome {
    /// Every answer a router gave, in the order each client got them.
    pub answers: Vec<(u16, String)>,
    /// Attempts that reached no router at all.
    pub unanswered: usize,
}

impl Traffic {
    pub fn start(ns: &str, name: &str, prompt: &str, clients: usize) -> Traffic {
        use std::sync::atomic::Ordering::SeqCst;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let view = std::sync::Arc::new(std::sync::RwLock::new(router_endpoints(cluster(), ns, name)));
        let endpoints = {
            let (stop, view, ns, name) = (stop.clone(), view.clone(), ns.to_string(), name.to_string());
            std::thread::spawn(move || {
                while !stop.load(SeqCst) {
                    *view.write().unwrap() = router_endpoints(cluster(), &ns, &name);
                    std::thread::sleep(Duration::from_millis(500));
                }
            })
        };
        let clients = (0..clients)
            .map(|c| {
                let (stop, view, prompt) = (stop.clone(), view.clone(), prompt.to_string());
                std::thread::spawn(move || {
                    let mut attempts = Vec::new();
                    for n in c.. {
                        if stop.load(SeqCst) {
                            break;
                        }
                        let router = {
                            let v = view.read().unwrap();
                            (!v.is_empty()).then(|| v[n % v.len()].clone())
                        };
                        let sent = Instant::now();
                        attempts.push((sent, router.and_then(|r| complete(&r, &prompt, 8))));
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    attempts
                })
            })
            .collect();
        Traffic { stop, clients, endpoints }
    }

    /// Stops every client; what each request that reached a router got, and how many got no
    /// answer (no ready endpoint, or the router closed the connection without one).
    pub fn stop(self) -> Outcome {
        let attempts = self.stop_timed();
        let unanswered = attempts.iter().filter(|(_, a)| a.is_none()).count();
        let answers: Vec<(u16, String)> = attempts.into_iter().filter_map(|(_, answer)| answer).collect();
        eprintln!("traffic: {} attempts answered, {unanswered} reached no router", answers.len());
        Outcome { answers, unanswered }
    }

    /// Stops every client; every attempt, in the order each client made them.
    pub fn stop_timed(self) -> Vec<Attempt> {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let attempts = self.clients.into_iter().flat_map(|c| c.join().unwrap()).collect();
        self.endpoints.join().unwrap();
        attempts
    }
}

/// The `error.code` of a failed request's JSON body.
pub fn error_code(body: &str) -> Option<String> {
    serde_json::from_str::<Value>(body).ok()?["error"]["code"].as_str().map(String::from)
}

/// `ip:port` of a pod's container port named `http`.
pub fn pod_http(pod: &Value) -> Option<String> {
    let ip = pod["status"]["podIP"].as_str()?;
    let port = pod["spec"]["containers"][0]["ports"].as_array()?.iter().find(|p| p["name"] == "http")?["containerPort"].as_i64()?;
    Some(format!("{ip}:{port}"))
}

/// Every answer is a 200 with `reference`, or a failure whose JSON names its code; (served,
/// failed).
pub fn never_wrong(answers: &[(u16, String)], reference: &str) -> (usize, usize) {
    let (mut ok, mut failed) = (0, 0);
    for (i, (status, body)) in answers.iter().enumerate() {
        if *status == 200 {
            assert_eq!(completion_text(body).as_deref(), Some(reference), "request {i}: a 200 with other text: {body}");
            ok += 1;
        } else {
            assert!(error_code(body).is_some(), "request {i}: a failure that does not say what failed: {status} {body}");
            failed += 1;
        }
    }
    (ok, failed)
}

/// A namespace for pods that mount a node directory (the engine tests' models): Pod Security's
/// `restricted` and `baseline` profiles forbid hostPath volumes (a cluster would give the engine
/// a PersistentVolumeClaim); everything else the operator renders is `restricted`.
pub fn models_namespace(cp: &ControlPlane, prefix: &str) -> String {
    let ns = cp.namespace(prefix);
    cp.kubectl_ok(&["label", "namespace", &ns, "pod-security.kubernetes.io/enforce=privileged"]);
    ns
}
