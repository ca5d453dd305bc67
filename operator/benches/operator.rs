//! Operator benchmarks on the real test control plane (`make bench`): time from applying a spec
//! the gate must refuse to `RolloutRefused`, memory with 100 InferenceDeployments, and
//! reconciles per second. Prints a Markdown table (the README's numbers come from here).

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use support::*;

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()?.parse().ok()).unwrap_or(0)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    xs[xs.len() / 2]
}

fn wait(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "{what} did not happen within {timeout:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn main() {
    let cp = cluster();
    let op = Operator::start(cp, "operator-bench");
    let mut rows = Vec::new();

    // 1. Refusal latency: a window bigger than the pools, applied on a fresh namespace each run.
    let runs = 5;
    let (mut from_apply, mut from_report) = (Vec::new(), Vec::new());
    for i in 0..runs {
        let ns = cp.namespace("bench-refuse");
        let start = Instant::now();
        apply_yaml(cp, &ns, &tiny(&format!("r{i}"), 4096, 1024, 1024, ""));
        // The moment the prefill pod first answers its capacity report.
        let mut reported = None;
        wait("RolloutRefused", Duration::from_secs(120), || {
            if reported.is_none() {
                let pods = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/component=prefill"]);
                if let Some(ip) = pods["items"][0]["status"]["podIP"].as_str()
                    && get(&format!("http://{ip}:8081/v1/kv-pool")).is_some()
                {
                    reported = Some(Instant::now());
                }
            }
            condition_true(&infd(cp, &ns, &format!("r{i}")), "RolloutRefused")
        });
        let done = Instant::now();
        from_apply.push((done - start).as_secs_f64());
        if let Some(r) = reported {
            from_report.push((done - r).as_secs_f64());
        }
        cp.kubectl_ok(&["delete", "namespace", &ns, "--wait=false"]);
    }
    rows.push((format!("apply -> RolloutRefused (median of {runs})"), format!("{:.2} s", median(from_apply))));
    if !from_report.is_empty() {
        rows.push(("prefill pod's first report -> RolloutRefused (median)".to_string(), format!("{:.2} s", median(from_report))));
    }

    // 2. Rollback latency: a revision whose prefill corrupts a page of every handoff after its
    // 20th (test image) is promoted over a good one and baked under four clients; from the first
    // mismatch any decode pod counts to phase RolledBack.
    let mut to_rollback = Vec::new();
    for i in 0..3 {
        let ns = cp.namespace("bench-rollback");
        let name = format!("b{i}");
        apply_yaml(cp, &ns, &tiny(&name, 256, 1024, 1024, ""));
        wait("Available", Duration::from_secs(120), || infd(cp, &ns, &name)["status"]["phase"] == "Available");
        let image = kvgate_testenv::images::faulty_worker("corrupt-after-20");
        apply_yaml(cp, &ns, &with_image(&format!("{}  rollout: {{ bakeSeconds: 600 }}\n", tiny(&name, 256, 1024, 1024, "")), &image));
        wait("Baking", Duration::from_secs(120), || infd(cp, &ns, &name)["status"]["phase"] == "Baking");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let clients: Vec<_> = (0..4)
            .map(|_| {
                let (stop, ns, name) = (stop.clone(), ns.clone(), name.clone());
                std::thread::spawn(move || {
                    let cp = cluster();
                    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                        if let Some(router) = router_endpoints(cp, &ns, &name).pop() {
                            for _ in 0..10 {
                                let _ = complete(&router, "The quick brown fox jumps over the lazy dog", 4);
                            }
                        }
                    }
                })
            })
            .collect();
        let decode_ips = || -> Vec<String> {
            let pods = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/component=decode"]);
            pods["items"].as_array().into_iter().flatten().filter_map(|p| p["status"]["podIP"].as_str().map(String::from)).collect()
        };
        let ips = decode_ips();
        let mismatched = || {
            ips.iter().any(|ip| {
                get(&format!("http://{ip}:8082/metrics")).is_some_and(|t| kvgate_testenv::metrics::family_sum(&t, "kvgate_handoff_mismatch_total") > 0.0)
            })
        };
        wait("the first mismatch", Duration::from_secs(120), mismatched);
        let first = Instant::now();
        wait("RolledBack", Duration::from_secs(120), || infd(cp, &ns, &name)["status"]["phase"] == "RolledBack");
        to_rollback.push(first.elapsed().as_secs_f64());
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        for c in clients {
            c.join().unwrap();
        }
        cp.kubectl_ok(&["delete", "namespace", &ns, "--wait=false"]);
    }
    rows.push((format!("first handoff mismatch -> RolledBack (median of {}, aim <= 5 s)", to_rollback.len()), format!("{:.2} s", median(to_rollback))));

    // 3. Memory and reconcile rate with 100 InferenceDeployments (no pods: replicas 0, so this
    // measures the operator, not the workers).
    let ns = cp.namespace("bench-scale");
    let idle = rss_kib(op.proc.pid());
    let n = 100;
    let yaml: String =
        (0..n).map(|i| tiny(&format!("s{i:03}"), 256, 1024, 1024, "").replace("replicas: 1", "replicas: 0") + "  router: { replicas: 0 }\n---\n").collect();
    let start = Instant::now();
    apply_yaml(cp, &ns, &yaml);
    let all_have_status = || {
        let list = get_json(cp, &["-n", &ns, "get", "infd"]);
        list["items"].as_array().is_some_and(|a| a.len() == n && a.iter().all(|d| d["status"]["observedGeneration"].is_number()))
    };
    wait("100 statuses", Duration::from_secs(300), all_have_status);
    let first_pass = start.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_secs(3));
    let loaded = rss_kib(op.proc.pid());
    rows.push((format!("operator RSS, idle / with {n} InferenceDeployments"), format!("{:.1} MiB / {:.1} MiB", idle as f64 / 1024.0, loaded as f64 / 1024.0)));
    rows.push((format!("create {n} -> every status written"), format!("{first_pass:.1} s ({:.0} deployments/s)", n as f64 / first_pass)));
    // A restarted operator reconciles all of them again; nothing changed, so nothing is written.
    drop(op);
    let op = Operator::start(cp, "operator-bench-2");
    let start = Instant::now();
    wait("100 reconciles", Duration::from_secs(300), || op.metric(r#"kvgate_operator_reconcile_total{result="success"}"#).unwrap_or(0.0) >= n as f64);
    let t = start.elapsed().as_secs_f64();
    rows.push((format!("restart -> {n} idle reconciles"), format!("{t:.1} s ({:.0} reconciles/s)", n as f64 / t)));

    println!("\n| operator benchmark | result |\n| --- | --- |");
    for (k, v) in rows {
        println!("| {k} | {v} |");
    }
}
