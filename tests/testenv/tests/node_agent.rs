//! The node agent: Deployments become real local processes on their own addresses, listed in
//! their Services' EndpointSlices; readiness gates keep pods NotReady and out of those endpoints;
//! restarts and bad images are reported; RBAC applies to what a pod runs.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use kvgate_testenv::ControlPlane;
use kvgate_testenv::process::Proc;
use serde_json::Value;

fn workspace_bin(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/debug").join(name);
    assert!(p.is_file(), "{} not found: build it with `cargo build --workspace`", p.display());
    p
}

/// The control plane with one node agent, shared by this file's tests.
fn cluster() -> &'static ControlPlane {
    static AGENT: OnceLock<Proc> = OnceLock::new();
    let cp = ControlPlane::shared();
    AGENT.get_or_init(|| {
        let worker = workspace_bin("kvgate-worker");
        let kubectl = PathBuf::from(std::env::var("KUBECTL").unwrap_or_else(|_| "/usr/bin/kubectl".into()));
        cp.node_agent(Path::new(env!("CARGO_BIN_EXE_kvgate-node-agent")), "node-1", &[("kvgate/worker", &worker), ("kvgate/kubectl", &kubectl)])
            .unwrap_or_else(|e| panic!("node agent: {e:#}"))
    });
    cp
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
    kvgate_testenv::wait::eventually(what, timeout, Duration::from_millis(250), check, || cp.logs());
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
    kvgate_testenv::http::get(&format!("http://{ip}:8080/healthz")).is_some()
}

const WORKER: &str = r#"
      containers:
      - name: worker
        image: kvgate/worker:test
        args: ["local", "--colocated", "--listen=$(POD_IP):8080", "--context-window=64", "--kv-pool-tokens=256"]
        env:
        - name: POD_IP
          valueFrom: { fieldRef: { fieldPath: status.podIP } }
        ports: [{ name: http, containerPort: 8080 }]
        readinessProbe: { httpGet: { path: /readyz, port: http }, periodSeconds: 1 }
      terminationGracePeriodSeconds: 2
"#;

#[test]
fn a_worker_deployment_runs_as_processes_on_their_own_addresses() {
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
    assert_ne!(ips[0], ips[1]);
    for ip in &ips {
        assert!(ip.starts_with("198.18."), "{ip}");
        assert!(http_ok(ip), "worker on {ip} does not answer");
    }
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
    format!("apiVersion: v1\nkind: Service\nmetadata: {{ name: {app} }}\nspec:\n  selector: {{ app: {app} }}\n  ports: [{{ port: 8080, targetPort: http }}]\n")
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
fn exits_are_restarted_and_unknown_images_fail_clearly() {
    let cp = cluster();
    let ns = cp.namespace("restart");
    apply(
        cp,
        &ns,
        "apiVersion: v1\nkind: Pod\nmetadata: { name: crasher }\nspec:\n  containers:\n  - name: c\n    image: kvgate/worker:test\n    args: [\"--no-such-flag\"]\n---\napiVersion: v1\nkind: Pod\nmetadata: { name: nosuch }\nspec:\n  containers:\n  - name: c\n    image: example.com/not-here:1\n",
    );
    eventually(cp, "a restart", Duration::from_secs(60), || {
        json(cp, &["-n", &ns, "get", "pod", "crasher"])["status"]["containerStatuses"][0]["restartCount"].as_i64().unwrap_or(0) >= 1
    });
    eventually(cp, "ErrImagePull", Duration::from_secs(30), || {
        let s = json(cp, &["-n", &ns, "get", "pod", "nosuch"]);
        let w = &s["status"]["containerStatuses"][0]["state"]["waiting"];
        w["reason"] == "ErrImagePull" && w["message"].as_str().unwrap_or("").contains("not-here")
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
