//! Operator benchmarks on the real test control plane (`make bench`): time from applying a spec
//! the gate must refuse to `RolloutRefused`, from a first handoff mismatch to a rollback, and at
//! scale (1,000 idle and 10 serving InferenceDeployments): memory, time to every status, the
//! requests the operator and the routers send while nothing changes (the API server's audit
//! log), a restart, and a failover to a warm and to a cold standby. Prints a Markdown table
//! (docs/benchmarks.md's numbers come from here).

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
    // The audit log counts who sends the API server what (section 3).
    kvgate_testenv::ControlPlane::shared_with(kvgate_testenv::Options { crds: true, audit: true });
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
        let image = kvgate_testenv::images::faulty_worker("corrupt-after-100");
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

    // 3. Scale, side by side in one run: 1,000 idle InferenceDeployments (no pods: replicas 0)
    // and 10 serving ones (router, prefill, decode each). The operator's memory, the time until
    // every status is written, then a quiet minute in which the API server's audit log counts
    // every request the operator and the routers send, then a restart.
    let (n_idle, n_serving) = (1000, 10);
    let idle_ns = cp.namespace("bench-scale");
    let serving_ns = cp.restricted_namespace("bench-serving");
    let rss_before = rss_kib(op.proc.pid());
    let idle: String = (0..n_idle)
        .map(|i| tiny(&format!("s{i:04}"), 256, 1024, 1024, "").replace("replicas: 1", "replicas: 0") + "  router: { replicas: 0 }\n---\n")
        .collect();
    let serving: String = (0..n_serving).map(|i| tiny(&format!("live{i:02}"), 256, 1024, 1024, "") + "---\n").collect();
    let start = Instant::now();
    apply_yaml(cp, &serving_ns, &serving);
    apply_yaml(cp, &idle_ns, &idle);
    let settled = |ns: &str, n: usize, phase: Option<&str>| {
        let list = get_json(cp, &["-n", ns, "get", "infd"]);
        list["items"]
            .as_array()
            .is_some_and(|a| a.len() == n && a.iter().all(|d| d["status"]["observedGeneration"].is_number() && phase.is_none_or(|p| d["status"]["phase"] == p)))
    };
    wait("every status written and the serving ones Available", Duration::from_secs(1800), || {
        settled(&idle_ns, n_idle, None) && settled(&serving_ns, n_serving, Some("Available"))
    });
    let to_status = start.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_secs(10));
    let rss_loaded = rss_kib(op.proc.pid());
    let total = n_idle + n_serving;
    rows.push((
        format!("operator RSS, idle / with {n_idle} idle + {n_serving} serving InferenceDeployments (aim <= 64 MiB)"),
        format!("{:.1} MiB / {:.1} MiB", rss_before as f64 / 1024.0, rss_loaded as f64 / 1024.0),
    ));
    rows.push((
        format!("create {total} -> every status written, the {n_serving} serving Available"),
        format!("{to_status:.1} s ({:.0} deployments/s)", total as f64 / to_status),
    ));

    // The quiet minute: nothing changes; who asks the API server what?
    let quiet = Duration::from_secs(60);
    let from = k8s_openapi::jiff::Timestamp::now();
    std::thread::sleep(quiet);
    let to = k8s_openapi::jiff::Timestamp::now();
    let requests = kvgate_testenv::audit::requests(&cp.audit_log(), from, to);
    let per_s = |ua: &str, pick: &dyn Fn(&kvgate_testenv::audit::Request) -> bool| {
        requests.iter().filter(|r| r.user_agent.starts_with(ua) && pick(r)).count() as f64 / quiet.as_secs_f64()
    };
    let reads = |r: &kvgate_testenv::audit::Request| matches!(r.verb.as_str(), "get" | "list");
    let lease = |r: &kvgate_testenv::audit::Request| r.resource == "leases";
    for (who, ua) in [("the operator", "kvgate-operator/"), (&*format!("the {n_serving} routers together"), "kvgate-router/")] {
        rows.push((
            format!("requests/s from {who} while nothing changes: GET+LIST / new WATCH / writes (aim: no periodic GET or LIST)"),
            format!(
                "{:.2} / {:.2} / {:.2} (of which the leader Lease's renewals {:.2})",
                per_s(ua, &|r| reads(r) && !lease(r)),
                per_s(ua, &|r| r.verb == "watch"),
                per_s(ua, &|r| r.writes()),
                per_s(ua, &|r| lease(r)),
            ),
        ));
    }

    // A restarted operator reconciles every deployment again; nothing changed, so it writes
    // nothing (no apply, no status, no pod condition; only its Lease).
    drop(op);
    let op = Operator::start(cp, "operator-bench-2");
    let from = k8s_openapi::jiff::Timestamp::now();
    let start = Instant::now();
    wait("every deployment reconciled", Duration::from_secs(900), || {
        op.metric(r#"kvgate_operator_reconcile_total{result="success"}"#).unwrap_or(0.0) >= total as f64
    });
    let t = start.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_secs(2));
    let writes: Vec<_> = kvgate_testenv::audit::requests(&cp.audit_log(), from, k8s_openapi::jiff::Timestamp::now())
        .into_iter()
        .filter(|r| r.user_agent.starts_with("kvgate-operator/") && r.writes() && r.resource != "leases")
        .collect();
    rows.push((
        format!("restart -> {total} reconciles; writes they made besides the Lease"),
        format!(
            "{t:.1} s ({:.0} reconciles/s); {} writes{}",
            total as f64 / t,
            writes.len(),
            writes.first().map(|w| format!(" (first: {} {})", w.verb, w.resource)).unwrap_or_default()
        ),
    ));
    rows.push(("operator RSS after the restart and every reconcile".to_string(), format!("{:.1} MiB", rss_kib(op.proc.pid()) as f64 / 1024.0)));

    // 4. Failover, warm standby against cold, side by side: a standby waits beside the leader;
    // the leader is SIGKILLed (its Lease runs out: 15 s) and a new deployment is applied at once.
    // From the kill: the Lease taken; from taking it: that deployment's status written (the new
    // leader's first write) and every deployment reconciled.
    let mut leader = op;
    for (i, (kind, extra)) in [("warm", &[][..]), ("cold", &["--cold-standby"][..])].into_iter().enumerate() {
        let standby = Operator::start_with(cp, &format!("operator-bench-{kind}"), "kvgate-operator", None, extra);
        let synced = if kind == "warm" { 1.0 } else { 0.0 };
        wait("the standby ready", Duration::from_secs(600), || standby.metric("kvgate_operator_watches_synced") == Some(synced));
        std::thread::sleep(Duration::from_secs(10));
        let standby_rss = rss_kib(standby.proc.pid());
        let reconciled = |op: &Operator| op.metric(r#"kvgate_operator_reconcile_total{result="success"}"#).unwrap_or(0.0);
        leader.proc.kill();
        let killed = Instant::now();
        let name = format!("failover{i}");
        apply_yaml(cp, &idle_ns, &(tiny(&name, 256, 1024, 1024, "").replace("replicas: 1", "replicas: 0") + "  router: { replicas: 0 }\n"));
        wait("the standby leading", Duration::from_secs(120), || standby.metric("kvgate_operator_leader") == Some(1.0));
        let took = Instant::now();
        let (mut first_write, mut all) = (None, None);
        wait("the new deployment's status and every reconcile", Duration::from_secs(900), || {
            if first_write.is_none() && infd(cp, &idle_ns, &name)["status"]["observedGeneration"].is_number() {
                first_write = Some(took.elapsed());
            }
            if all.is_none() && reconciled(&standby) >= (total + 1 + i) as f64 {
                all = Some(took.elapsed());
            }
            first_write.is_some() && all.is_some()
        });
        rows.push((
            format!(
                "failover, {kind} standby (its RSS while standing by): leader killed -> Lease taken; -> first write; -> {} reconcile passes",
                total + 1 + i
            ),
            format!(
                "{:.1} MiB; {:.1} s; +{:.2} s; +{:.1} s",
                standby_rss as f64 / 1024.0,
                (took - killed).as_secs_f64(),
                first_write.unwrap().as_secs_f64(),
                all.unwrap().as_secs_f64()
            ),
        ));
        leader = standby;
    }
    drop(leader);

    println!("\n| operator benchmark | result |\n| --- | --- |");
    for (k, v) in rows {
        println!("| {k} | {v} |");
    }
}
