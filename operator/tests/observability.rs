//! Dashboards and alert rules: conventions, promtool unit tests, and a live Prometheus that
//! scrapes the operator and the worker pods of real deployments on the test control plane, plus
//! router, prefill and decode processes replaying the incident's bug (`ignore-rejection`): the
//! integrity and refused-rollout alerts fire and the integrity alert is delivered through a real
//! Alertmanager to a webhook, every metric the panels and rules name is really exported, and
//! every panel query returns data. Pods and the operator export traces to a real Jaeger: one
//! trace per request across the router, prefill and decode pods, a corrupting revision's error
//! span in its canary's trace, and docs/observability.md's walk from a mismatch to its request replayed.

mod support;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use kvgate_testenv::alertmanager::Alertmanager;
use kvgate_testenv::process::{Proc, free_port, tail};
use serde_json::Value;
use support::*;

const DASHBOARDS: [&str; 4] = ["integrity", "capacity", "serving", "operator"];

fn tool(name: &str) -> PathBuf {
    let found = Command::new("sh").arg("-c").arg(format!("command -v {name}")).output().unwrap();
    assert!(found.status.success(), "{name} not found: install Debian's prometheus package (`apt-get install prometheus`, which `make test-deps` does)");
    PathBuf::from(String::from_utf8(found.stdout).unwrap().trim())
}

fn dashboard(name: &str) -> Value {
    let text = std::fs::read_to_string(repo(&format!("dashboards/{name}.json"))).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("dashboards/{name}.json: {e}"))
}

/// Every (panel title, expr) of a dashboard.
fn queries(d: &Value) -> Vec<(String, String)> {
    d["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter().map(move |t| (p["title"].as_str().unwrap().to_string(), t["expr"].as_str().unwrap().to_string())))
        .collect()
}

fn alert_rules() -> Vec<Value> {
    let text = std::fs::read_to_string(repo("dashboards/alerts.yaml")).unwrap();
    let y: Value = serde_yaml::from_str(&text).unwrap();
    y["groups"].as_array().unwrap().iter().flat_map(|g| g["rules"].as_array().unwrap().clone()).collect()
}

/// kvgate metric names an expression uses (histogram series map to their family).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("kvgate_") {
        let start = i + at;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        let name = &expr[start..end];
        let family = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(name);
        out.insert(family.to_string());
        i = end;
    }
    out
}

/// The label matchers an expression puts on `metric`, each selector as written (`""` when bare).
fn selectors<'e>(expr: &'e str, metric: &str) -> Vec<&'e str> {
    expr.match_indices(metric)
        .filter(|(at, _)| !expr[at + metric.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_'))
        .map(|(at, _)| {
            let rest = &expr[at + metric.len()..];
            if rest.starts_with('{') { &rest[..rest.find('}').map_or(rest.len(), |e| e + 1)] } else { "" }
        })
        .collect()
}

#[test]
fn the_integrity_alert_covers_every_mismatch_reason() {
    use kvgate_proto::refusal::Mismatch;
    let rule = alert_rules().into_iter().find(|r| r["alert"] == "KvgateHandoffIntegrityViolation").expect("the integrity alert");
    let expr = rule["expr"].as_str().unwrap();
    let sels = selectors(expr, "kvgate_handoff_mismatch_total");
    assert!(!sels.is_empty(), "the integrity alert does not read kvgate_handoff_mismatch_total: {expr}");
    for sel in sels {
        // A bare series covers every reason; a reason matcher must name each one.
        if sel.contains("reason") {
            for m in Mismatch::ALL {
                assert!(sel.contains(m.as_str()) && !sel.contains("reason!"), "the integrity alert's {sel} leaves out reason {}", m.as_str());
            }
        }
    }
    assert!(expr.contains("by (namespace, deployment, pod, reason)"), "the alert names the reason: {expr}");
}

#[test]
fn dashboards_follow_the_conventions_and_are_generated() {
    let out = Command::new("python3").arg(repo("dashboards/generate.py")).arg("--check").output().expect("python3 is needed to check dashboards/generate.py");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut uids = Vec::new();
    for name in DASHBOARDS {
        let d = dashboard(name);
        uids.push(d["uid"].as_str().unwrap().to_string());
        assert!(d["schemaVersion"].as_i64().unwrap() >= 39, "{name}: schemaVersion");
        assert!(d["title"].as_str().unwrap().starts_with("kvgate / "), "{name}: title");
        let vars = d["templating"]["list"].as_array().unwrap();
        let datasources: Vec<&Value> = vars.iter().filter(|v| v["type"] == "datasource").collect();
        assert_eq!(datasources.len(), 1, "{name}: one datasource variable");
        assert_eq!((datasources[0]["name"].as_str(), datasources[0]["query"].as_str()), (Some("datasource"), Some("prometheus")));
        for var in ["namespace", "deployment"] {
            let v = vars.iter().find(|v| v["name"] == var).unwrap_or_else(|| panic!("{name}: no {var} variable"));
            assert_eq!(v["type"], "query");
            assert!(v["definition"].as_str().unwrap().starts_with("label_values("), "{name}: {var} from label values");
        }
        for p in d["panels"].as_array().unwrap() {
            let title = p["title"].as_str().unwrap();
            assert!(p["fieldConfig"]["defaults"]["unit"].as_str().is_some_and(|u| !u.is_empty()), "{name}/{title}: no unit");
            assert!(p["description"].as_str().is_some_and(|s| s.len() > 20), "{name}/{title}: no description");
            assert_eq!(p["datasource"]["uid"], "${datasource}", "{name}/{title}: hard-coded datasource");
            for t in p["targets"].as_array().unwrap() {
                assert_eq!(t["datasource"]["uid"], "${datasource}", "{name}/{title}: hard-coded datasource in a target");
                let expr = t["expr"].as_str().unwrap();
                for (at, _) in expr.match_indices("rate(") {
                    let window = expr[at..].split('[').nth(1).and_then(|w| w.split(']').next()).unwrap_or("");
                    assert_eq!(window, "$__rate_interval", "{name}/{title}: {expr}");
                }
            }
        }
    }
    assert_eq!(uids, ["kvgate-integrity", "kvgate-capacity", "kvgate-serving", "kvgate-operator"], "dashboard uids must stay stable");
    // The mismatch panels link to a Jaeger search for the refusals' spans, by reason and time.
    let integrity = dashboard("integrity");
    let mismatch_panels: Vec<&Value> = integrity["panels"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["targets"][0]["expr"].as_str().unwrap().contains("kvgate_handoff_mismatch_total"))
        .collect();
    assert!(!mismatch_panels.is_empty());
    for p in mismatch_panels {
        let url = p["fieldConfig"]["defaults"]["links"][0]["url"].as_str().unwrap_or_else(|| panic!("{}: no data link", p["title"]));
        for part in ["${jaeger}/search?", "service=kvgate-decode", "operation=handoff_receive", "start=${__from}000", "end=${__to}000"] {
            assert!(url.contains(part), "{}: {url} lacks {part}", p["title"]);
        }
        // What each finds in a real Jaeger: worker/tests/traces.rs.
        let by_reason = p["targets"][0]["expr"].as_str().unwrap().contains("by (reason)");
        assert_eq!(url.contains("error.type%22%3A%22${__field.labels.reason}"), by_reason, "{url}");
    }
}

#[test]
fn alert_rules_pass_promtool_and_follow_the_mixin_conventions() {
    let promtool = tool("promtool");
    let check = Command::new(&promtool).args(["check", "rules"]).arg(repo("dashboards/alerts.yaml")).output().unwrap();
    assert!(check.status.success(), "{}{}", String::from_utf8_lossy(&check.stdout), String::from_utf8_lossy(&check.stderr));
    let test = Command::new(&promtool).args(["test", "rules"]).arg(repo("dashboards/tests/alerts_test.yaml")).output().unwrap();
    assert!(test.status.success(), "{}{}", String::from_utf8_lossy(&test.stdout), String::from_utf8_lossy(&test.stderr));

    let tests = std::fs::read_to_string(repo("dashboards/tests/alerts_test.yaml")).unwrap();
    let runbooks = std::fs::read_to_string(repo("docs/runbooks.md")).unwrap();
    let readme = std::fs::read_to_string(repo("docs/observability.md")).unwrap();
    let want = [
        "KvgateHandoffIntegrityViolation",
        "KvgateRejectedRequestForwarded",
        "KvgateProbeMismatch",
        "KvgateEngineKVReadAfterExpiry",
        "KvgateKVPoolBelowContextWindow",
        "KvgateRolloutRefused",
        "KvgateServingPodUnverified",
        "KvgateHandoffFailuresHigh",
        "KvgateOperatorReconcileErrors",
        "KvgateOperatorDown",
        "KvgateWorkerMetricsAbsent",
        "KvgateKVPortAbuse",
        "KvgateInternalRequestsRefused",
        "KvgateListenerSaturated",
    ];
    let rules = alert_rules();
    let names: BTreeSet<&str> = rules.iter().map(|r| r["alert"].as_str().unwrap()).collect();
    assert_eq!(names, want.into_iter().collect(), "alert set");
    for r in &rules {
        let name = r["alert"].as_str().unwrap();
        assert!(["critical", "warning"].contains(&r["labels"]["severity"].as_str().unwrap_or("")), "{name}: severity");
        for a in ["summary", "description", "runbook_url"] {
            assert!(r["annotations"][a].as_str().is_some_and(|s| !s.is_empty()), "{name}: no {a}");
        }
        let anchor = name.to_lowercase();
        assert!(r["annotations"]["runbook_url"].as_str().unwrap().ends_with(&format!("docs/runbooks.md#{anchor}")), "{name}: runbook_url");
        assert!(runbooks.contains(&format!("\n## {name}\n")), "docs/runbooks.md has no section for {name}");
        assert!(tests.contains(&format!("alertname: {name}\n")), "dashboards/tests/alerts_test.yaml does not test {name}");
        assert!(
            readme.contains(&format!("\n| `{name}` | {} |", r["labels"]["severity"].as_str().unwrap())),
            "docs/observability.md's alert table has no row for {name}"
        );
    }
}

struct Prometheus {
    _proc: Proc,
    url: String,
}

impl Prometheus {
    fn start(dir: &std::path::Path, config: &str) -> Prometheus {
        let bin = tool("prometheus");
        let port = free_port();
        let cfg = dir.join("prometheus.yml");
        std::fs::write(&cfg, config).unwrap();
        let args = vec![
            format!("--config.file={}", cfg.display()),
            format!("--storage.tsdb.path={}", dir.join("prometheus-data").display()),
            format!("--web.listen-address=127.0.0.1:{port}"),
            "--web.enable-lifecycle".to_string(),
        ];
        let mut proc = Proc::spawn("prometheus", &bin, &args, dir).unwrap();
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while get(&format!("{url}/-/ready")).is_none() {
            proc.check_alive().unwrap_or_else(|e| panic!("{e:#}"));
            assert!(Instant::now() < deadline, "prometheus did not start:\n{}", tail(&proc.log, 30));
            std::thread::sleep(Duration::from_millis(200));
        }
        Prometheus { _proc: proc, url }
    }

    fn query(&self, expr: &str) -> Vec<Value> {
        let q: String =
            expr.bytes().map(|b| if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") }).collect();
        let body = get(&format!("{}/api/v1/query?query={q}", self.url)).unwrap_or_default();
        let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    fn firing(&self, alert: &str) -> Vec<Value> {
        let body = get(&format!("{}/api/v1/alerts", self.url)).unwrap_or_default();
        let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        v["data"]["alerts"].as_array().into_iter().flatten().filter(|a| a["labels"]["alertname"] == alert && a["state"] == "firing").cloned().collect()
    }
}

#[test]
fn a_live_prometheus_fires_the_alerts_and_every_panel_and_rule_has_its_metrics() {
    let cp = cluster();
    let ns = cp.restricted_namespace("observe");
    let op = Operator::start_in(cp, "operator-observe", "lease-observe", Some(&ns));
    apply_yaml(cp, &ns, &tiny("good", 256, 1024, 1024, ""));
    apply_yaml(cp, &ns, &tiny("small", 4096, 1024, 1024, ""));
    // A test image whose prefill exits after its 5th handoff and restarts with an eighth of its pool.
    let image = kvgate_testenv::images::faulty_worker("restart-smaller");
    apply_yaml(cp, &ns, &with_image(&tiny("shrinks", 256, 1024, 1024, ""), &image));

    // The incident's bug, replayed by real processes: a router with a big window, a prefill
    // whose pool is smaller and which forwards a prompt it rejected (`ignore-rejection`), and a
    // decode worker that catches it.
    let bin = workspace_bin("kvgate-worker");
    let (prefill_port, decode_port, kv_port, router_port) = (free_port(), free_port(), free_port(), free_port());
    let secret_file = cp.dir.join(format!("incident-secret-{ns}"));
    std::fs::write(&secret_file, "incident-deployment-secret-0123456789").unwrap();
    std::fs::set_permissions(&secret_file, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let secret = format!("--handoff-secret-file={}", secret_file.display());
    let spawn = |name: &str, args: &[String]| Proc::spawn(name, &bin, args, &cp.dir).unwrap();
    // The fault is switched on through the environment, as the test images do.
    let fault = [("KVGATE_INJECT_FAULT", "ignore-rejection"), ("KVGATE_ALLOW_FAULT_INJECTION", "true")].map(|(k, v)| (k.to_string(), v.to_string()));
    let prefill = Proc::spawn_with_env(
        "incident-prefill",
        &bin,
        &["prefill".into(), format!("--listen=127.0.0.1:{prefill_port}"), "--context-window=1024".into(), "--kv-pool-tokens=128".into(), secret.clone()],
        &fault,
        &cp.dir,
    )
    .unwrap();
    let decode = spawn(
        "incident-decode",
        &[
            "decode".into(),
            format!("--listen=127.0.0.1:{decode_port}"),
            format!("--kv-listen=127.0.0.1:{kv_port}"),
            "--context-window=1024".into(),
            secret.clone(),
        ],
    );
    let router = spawn(
        "incident-router",
        &[
            "router".into(),
            format!("--listen=127.0.0.1:{router_port}"),
            format!("--prefill=127.0.0.1:{prefill_port}"),
            format!("--decode=127.0.0.1:{decode_port}"),
            "--context-window=1024".into(),
            secret,
        ],
    );
    let incident_router = format!("127.0.0.1:{router_port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while get(&format!("http://{incident_router}/readyz")).is_none() {
        assert!(
            Instant::now() < deadline,
            "the incident workers did not start:\n{}\n{}\n{}",
            tail(&prefill.log, 10),
            tail(&decode.log, 10),
            tail(&router.log, 10)
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // Debian's Prometheus is built without Kubernetes service discovery, so the test plays the
    // PodMonitor: it lists the deployment's pods and writes them as file_sd targets, labelled as
    // the chart's PodMonitor relabels them (namespace, pod, deployment).
    let prom_dir = cp.dir.join(format!("prometheus-{ns}"));
    std::fs::create_dir_all(&prom_dir).unwrap();
    let targets_file = prom_dir.join("targets.json");
    std::fs::write(&targets_file, "[]").unwrap();
    let op_addr = op.metrics.trim_start_matches("http://").trim_end_matches("/metrics").to_string();
    // Alerts go where a platform team's would: Alertmanager, routing to a pager's webhook.
    let alertmanager = Alertmanager::start(&prom_dir.join("alertmanager")).unwrap_or_else(|e| panic!("{e:#}"));
    let config = format!(
        r#"
global: {{ scrape_interval: 1s, evaluation_interval: 1s }}
rule_files: ["{rules}"]
alerting:
  alertmanagers: [{{ static_configs: [{{ targets: ["{am}"] }}] }}]
scrape_configs:
  - job_name: kvgate-workers
    file_sd_configs: [{{ files: ["{targets}"], refresh_interval: 1s }}]
  - job_name: kvgate-operator
    honor_labels: true
    static_configs: [{{ targets: ["{op_addr}"], labels: {{ pod: operator-observe }} }}]
  - job_name: kvgate-incident
    static_configs:
      - {{ targets: ["127.0.0.1:{prefill_port}"], labels: {{ namespace: "{ns}", deployment: incident, pod: incident-prefill }} }}
      - {{ targets: ["127.0.0.1:{decode_port}"], labels: {{ namespace: "{ns}", deployment: incident, pod: incident-decode }} }}
      - {{ targets: ["127.0.0.1:{router_port}"], labels: {{ namespace: "{ns}", deployment: incident, pod: incident-router }} }}
"#,
        rules = repo("dashboards/alerts.yaml").display(),
        targets = targets_file.display(),
        am = alertmanager.addr,
    );
    let prom = Prometheus::start(&prom_dir, &config);

    eventually(cp, &ns, "good and shrinks Available, small Refused", Duration::from_secs(120), || {
        ["good", "shrinks"].iter().all(|n| infd(cp, &ns, n)["status"]["phase"] == "Available") && infd(cp, &ns, "small")["status"]["phase"] == "Refused"
    });
    let router = ready_router(cp, &ns, "good", Duration::from_secs(60));
    let targets: Vec<Value> = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/name=kvgate"])["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| {
            Some(serde_json::json!({ "targets": [pod_http(p)?], "labels": {
                "namespace": ns, "pod": p["metadata"]["name"], "deployment": p["metadata"]["labels"]["app.kubernetes.io/instance"] } }))
        })
        .collect();
    std::fs::write(&targets_file, serde_json::to_string(&targets).unwrap()).unwrap();
    // Counters must be scraped at their starting values first: Prometheus sees no increase in
    // a series whose first sample already counts the failures.
    eventually(cp, &ns, "every target scraped", Duration::from_secs(60), || {
        prom.query(r#"up{job="kvgate-workers"} == 1"#).len() == targets.len()
            && prom.query(r#"up{job="kvgate-incident"} == 1"#).len() == 3
            && !prom.query(r#"kvgate_handoff_mismatch_total{deployment="incident"}"#).is_empty()
            && !prom.query("kvgate_operator_leader").is_empty()
    });
    // Traffic: good requests through the cluster, and the incident's too-long prompt.
    for i in 0..6 {
        assert_eq!(complete(&router, &format!("hello {i}"), 4).map(|r| r.0), Some(200));
    }
    let (status, body) = complete(&incident_router, &"y".repeat(299), 4).expect("the incident router answers");
    assert_eq!(status, 413, "prefill rejects the prompt: {body}");
    assert_eq!(complete(&incident_router, "short", 4).map(|r| r.0), Some(200));

    // Both integrity alerts page within a bounded time, locating the decode pod.
    let started = Instant::now();
    for alert in ["KvgateHandoffIntegrityViolation", "KvgateRejectedRequestForwarded"] {
        eventually(cp, &ns, &format!("{alert} firing"), Duration::from_secs(60), || {
            prom.firing(alert).iter().any(|a| a["labels"]["deployment"] == "incident" && a["labels"]["pod"] == "incident-decode")
        });
        eprintln!("{alert} fired {:.1} s after the request", started.elapsed().as_secs_f64());
    }
    assert!(prom.firing("KvgateHandoffIntegrityViolation").iter().all(|a| a["labels"]["reason"] == "rejected_forwarded"));
    // ... and reaches the pager through Alertmanager, with what the on-call needs to act.
    let delivered = |name: &str| {
        alertmanager.alerts().into_iter().find(|a| a["labels"]["alertname"] == name && a["status"] == "firing" && a["labels"]["deployment"] == "incident")
    };
    eventually(cp, &ns, "KvgateHandoffIntegrityViolation delivered to the webhook", Duration::from_secs(60), || {
        delivered("KvgateHandoffIntegrityViolation").is_some()
    });
    let page = delivered("KvgateHandoffIntegrityViolation").unwrap();
    assert_eq!((page["labels"]["pod"].as_str(), page["labels"]["reason"].as_str()), (Some("incident-decode"), Some("rejected_forwarded")), "{page}");
    assert_eq!(page["labels"]["severity"], "critical", "{page}");
    assert!(page["annotations"]["summary"].as_str().is_some_and(|s| s.contains("rejected_forwarded")), "{page}");
    assert!(
        page["annotations"]["runbook_url"].as_str().is_some_and(|u| u.ends_with("docs/runbooks.md#kvgatehandoffintegrityviolation")),
        "{page}\n{}",
        alertmanager.log()
    );
    eventually(cp, &ns, "KvgateRolloutRefused firing for small", Duration::from_secs(60), || {
        prom.firing("KvgateRolloutRefused").iter().any(|a| a["labels"]["name"] == "small" && a["labels"]["namespace"] == ns.as_str())
    });
    assert!(prom.firing("KvgateRolloutRefused").iter().all(|a| a["labels"]["name"] != "good"));

    // A serving pod restarts with a smaller pool: read again, its gate goes False (out of the
    // EndpointSlices, so it serves nothing), the deployment is Degraded and the alert fires.
    assert!(prom.firing("KvgateServingPodUnverified").is_empty(), "fired before any pod failed");
    let shrinks = router_endpoints(cp, &ns, "shrinks").pop().expect("shrinks' router");
    let prefill_pod =
        || get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/instance=shrinks,app.kubernetes.io/component=prefill"])["items"][0].clone();
    eventually(cp, &ns, "shrinks' prefill restarted", Duration::from_secs(60), || {
        let _ = complete(&shrinks, "hello", 2);
        prefill_pod()["status"]["containerStatuses"][0]["restartCount"].as_i64().unwrap_or(0) >= 1
    });
    eventually(cp, &ns, "shrinks Degraded", Duration::from_secs(60), || condition_true(&infd(cp, &ns, "shrinks"), "Degraded"));
    let d = infd(cp, &ns, "shrinks");
    let degraded = condition(&d, "Degraded").unwrap();
    assert_eq!(degraded["reason"], "ServingPodUnverified", "{d}");
    assert!(degraded["message"].as_str().unwrap().contains("measured 128 tokens < contextWindow 256"), "{degraded}");
    let wants = [
        "shrinks (kvgate engine, contextWindow 256): Degraded (ServingPodUnverified)",
        "gate closed KVPoolBelowContextWindow",
        "measured 128 tokens < contextWindow 256",
    ];
    why_says(cp, &ns, "shrinks", 1, &wants);
    let pod = prefill_pod();
    let gate = pod["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "kvgate.dev/kv-pool-verified").cloned().unwrap();
    assert_eq!((gate["status"].as_str(), gate["reason"].as_str()), (Some("False"), Some("KVPoolBelowContextWindow")), "{pod}");
    assert!(!condition_true(&pod, "Ready"), "{pod}");
    let slices = get_json(cp, &["-n", &ns, "get", "endpointslices", "-l", "kubernetes.io/service-name=shrinks-prefill"]);
    let pod_ip = pod["status"]["podIP"].clone();
    let offered = slices["items"].as_array().unwrap().iter().flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default());
    assert!(offered.filter(|e| e["addresses"][0] == pod_ip).all(|e| e["conditions"]["ready"] == false), "{slices}");
    eventually(cp, &ns, "KvgateServingPodUnverified firing for shrinks", Duration::from_secs(60), || {
        prom.firing("KvgateServingPodUnverified").iter().any(|a| a["labels"]["name"] == "shrinks" && a["labels"]["namespace"] == ns.as_str())
    });
    assert!(prom.firing("KvgateServingPodUnverified").iter().all(|a| a["labels"]["name"] == "shrinks"));

    // Every metric named by a panel or a rule is exported by a live worker or the operator.
    let mut exported = BTreeSet::new();
    let mut live = vec![op.metrics.clone()];
    live.extend([prefill_port, decode_port, router_port].map(|p| format!("http://127.0.0.1:{p}/metrics")));
    for p in get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/instance=good"])["items"].as_array().unwrap() {
        live.push(format!("http://{}/metrics", pod_http(p).unwrap()));
    }
    for url in &live {
        let text = get(url).unwrap_or_else(|| panic!("{url} did not answer"));
        exported.extend(text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter_map(|l| l.split_whitespace().next()).map(String::from));
    }
    let mut used = BTreeSet::new();
    for name in DASHBOARDS {
        for (_, expr) in queries(&dashboard(name)) {
            used.extend(metric_names(&expr));
        }
    }
    for r in alert_rules() {
        used.extend(metric_names(r["expr"].as_str().unwrap()));
    }
    let missing: Vec<&String> = used.iter().filter(|m| !exported.contains(*m)).collect();
    assert!(missing.is_empty(), "panels or rules use metrics nothing exports: {missing:?}");

    // The metrics reference (docs/observability.md) lists exactly what is exported, with the right types.
    let readme = std::fs::read_to_string(repo("docs/observability.md")).unwrap();
    let documented: BTreeSet<String> =
        readme.lines().filter_map(|l| l.strip_prefix("| `kvgate_")).filter_map(|l| l.split('`').next()).map(|n| format!("kvgate_{n}")).collect();
    let ours: BTreeSet<String> = exported.iter().filter(|m| m.starts_with("kvgate_")).cloned().collect();
    assert_eq!(documented, ours, "docs/observability.md's metrics tables and the live /metrics differ");
    for url in &live {
        for l in get(url).unwrap().lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
            let mut w = l.split_whitespace();
            let (name, kind) = (w.next().unwrap(), w.next().unwrap());
            let row = readme.lines().find(|r| r.starts_with(&format!("| `{name}` |"))).unwrap();
            assert!(row.contains(&format!("| {kind} |")), "docs/observability.md's row for {name} does not say {kind}: {row}");
        }
    }

    // Every panel query, with the variables filled in, returns data from this Prometheus.
    let fill = |expr: &str| expr.replace("$namespace", &ns).replace("$deployment", ".*").replace("$__rate_interval", "1m").replace("$__range", "10m");
    for name in DASHBOARDS {
        for (title, expr) in queries(&dashboard(name)) {
            let q = fill(&expr);
            let deadline = Instant::now() + Duration::from_secs(30);
            while prom.query(&q).is_empty() {
                assert!(Instant::now() < deadline, "{name} / {title}: no data for {q}\n{}", diagnostics(cp, &ns));
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    }
    drop((prefill, decode, router));
}

#[test]
fn pods_export_one_trace_per_request_and_a_corrupting_revision_gives_an_error_span_decode_logs_under_it() {
    use kvgate_testenv::jaeger::{Jaeger, Trace};
    let cp = cluster();
    let ns = cp.restricted_namespace("traced");
    // Jaeger in the test world's namespace, its OTLP port reachable from the pods' bridge.
    let jaeger = Jaeger::start_receiving_on(&cp.dir.join("jaeger"), "0.0.0.0").unwrap_or_else(|e| panic!("{e:#}"));
    let endpoint = jaeger.pods_otlp_endpoint();
    let _op = Operator::start_with_env(
        cp,
        "operator-traced",
        "lease-traced",
        Some(&ns),
        &[&format!("--worker-otlp-endpoint={endpoint}")],
        &[&format!("OTEL_EXPORTER_OTLP_ENDPOINT={}", jaeger.otlp_endpoint), "OTEL_BSP_SCHEDULE_DELAY=100"],
    );
    apply_yaml(cp, &ns, &tiny("llm", 256, 1024, 1024, ""));
    eventually(cp, &ns, "Available", Duration::from_secs(120), || infd(cp, &ns, "llm")["status"]["phase"] == "Available");

    // A client's request through the router pod: one trace, spans from all three pods.
    let router = router_endpoints(cp, &ns, "llm").pop().expect("a ready router");
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let body = serde_json::json!({ "prompt": "Hello", "max_tokens": 4, "temperature": 0 }).to_string();
    let out = std::process::Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", "content-type: application/json"])
        .args(["-H", &format!("traceparent: 00-{trace_id}-b7ad6b7169203331-01"), "-d", &body, &format!("http://{router}/v1/completions")])
        .output()
        .expect("curl");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
    let services = ["kvgate-router", "kvgate-prefill", "kvgate-decode"];
    // (Pods export in batches every 5 s, the SDK's default.)
    let whole = |t: &Trace| {
        t.has("kvgate-router", "POST /v1/completions")
            && t.has("kvgate-decode", "handoff_receive")
            && t.has("kvgate-decode", "decode")
            && t.has("kvgate-prefill", "handoff_send")
    };
    let trace = jaeger.wait_for(trace_id, Duration::from_secs(60), whole);
    assert_eq!(trace.services(), services.into_iter().collect(), "{:?}\n{}", trace.summary(), jaeger.log());
    // Each process is the pod it ran in (resource attributes from the rendered env).
    let pods = names_of(&get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/instance=llm"]));
    let raw = jaeger.trace(trace_id).unwrap();
    for (_, process) in raw["processes"].as_object().unwrap() {
        let pod = process["tags"].as_array().unwrap().iter().find(|t| t["key"] == "k8s.pod.name").map(|t| t["value"].as_str().unwrap().to_string());
        assert!(pod.as_ref().is_some_and(|p| pods.contains(p)), "{process} is none of the pods {pods:?}");
    }

    // A revision whose prefill corrupts every handoff: its integrity canary (traced by the
    // operator, its calls carrying the trace into the candidate pods) is refused on decode's
    // mismatch counter (the reason, though the request also failed), and decode's receipt is
    // an error span named for the reason.
    apply_yaml(cp, &ns, &with_image(&tiny("llm", 256, 1024, 1024, ""), &kvgate_testenv::images::faulty_worker("corrupt-page")));
    eventually(cp, &ns, "the corrupting revision refused by its canary", Duration::from_secs(180), || {
        infd(cp, &ns, "llm")["status"]["refusedRevision"]["reason"] == "HandoffIntegrityViolation"
    });
    let refused = "service=kvgate-decode&operation=handoff_receive&tags=%7B%22error.type%22%3A%22checksum%22%7D&lookback=1h&limit=20";
    let mut traces = Vec::new();
    eventually(cp, &ns, "decode's refused receipt in Jaeger", Duration::from_secs(30), || {
        traces = jaeger.search(refused);
        !traces.is_empty()
    });
    let refused_trace = jaeger.wait_for(&traces[0], Duration::from_secs(10), |t| t.has("kvgate-operator", "canary"));
    assert!(refused_trace.has("kvgate-operator", "canary"), "the refusal is not in the canary's trace: {:?}", refused_trace.summary());
    let receipt = refused_trace.spans().into_iter().find(|s| s.name == "handoff_receive" && s.is_error()).unwrap();
    assert_eq!(receipt.tag("otel.status_description"), Some(&serde_json::json!("checksum")));

    // The same corruption serving (no canary, no bake: nothing stops it), and a client's request
    // failing on it: docs/observability.md's walk from the mismatch to that request, replayed as written
    // with the real kubectl against the pods.
    // (A refused revision stays refused: another decode pool makes it another revision.)
    let serving = format!("{}  rollout:\n    canary: {{ prompts: 0 }}\n    bakeSeconds: 0\n", tiny("llm", 256, 1024, 1040, ""));
    let faulty = kvgate_testenv::images::faulty_worker("corrupt-page");
    apply_yaml(cp, &ns, &with_image(&serving, &faulty));
    // Settled: one pod per role, all of the new revision (the router follows the serving image).
    eventually(cp, &ns, "the corrupting revision serving", Duration::from_secs(180), || {
        let d = infd(cp, &ns, "llm");
        let pods = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/instance=llm"]);
        let pods = pods["items"].as_array().cloned().unwrap_or_default();
        d["status"]["phase"] == "Available"
            && pods.len() == 3
            && pods.iter().all(|p| p["spec"]["containers"][0]["image"] == faulty.as_str() && p["metadata"]["deletionTimestamp"].is_null())
            && router_endpoints(cp, &ns, "llm").len() == 1
    });
    let router = router_endpoints(cp, &ns, "llm").pop().unwrap();
    let long = "a prompt long enough for several pages of the tiny model's pool";
    let body = serde_json::json!({ "prompt": long, "max_tokens": 4, "temperature": 0 }).to_string();
    let out = std::process::Command::new("curl")
        .args([
            "-s",
            "-D",
            "-",
            "-H",
            "content-type: application/json",
            "-H",
            "x-request-id: walk-pods",
            "-d",
            &body,
            &format!("http://{router}/v1/completions"),
        ])
        .output()
        .expect("curl");
    let answer = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(answer.starts_with("HTTP/1.1 502") && answer.contains("kv_handoff_checksum"), "{answer}");
    let steps: Vec<String> =
        kvgate_testenv::readme::blocks("docs/observability.md", "## Finding the request behind a mismatch").iter().map(|b| b.replace("\\\n", " ")).collect();
    assert_eq!(steps.len(), 3, "{steps:?}");
    let kubectl_dir = kvgate_testenv::controlplane::bin_dir();
    let path = format!("{}:{}", kubectl_dir.display(), std::env::var("PATH").unwrap_or_default());
    let run = |step: &str, trace: &str| -> String {
        let out = std::process::Command::new("sh")
            .args(["-c", step])
            .env("PATH", &path)
            .env("KUBECONFIG", &cp.kubeconfig)
            .env("NS", &ns)
            .env("NAME", "llm")
            .env("JAEGER", &jaeger.query_url)
            .env("TRACE_ID", trace)
            .output()
            .unwrap();
        assert!(out.status.success(), "`{step}` failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    // 1. The decode pod's refusal, with the trace of the request.
    let mut rows = String::new();
    eventually(cp, &ns, "step 1 finds the refusal", Duration::from_secs(30), || {
        rows = run(&steps[0], "");
        !rows.is_empty()
    });
    let row: Vec<&str> = rows.lines().last().unwrap().split('\t').collect();
    assert_eq!(row[1], "checksum", "{rows}");
    let trace_id = row[3].to_string();
    // 2. Jaeger: the request's spans from the router, prefill and decode pods, the refusal among them.
    // (Each pod sends its spans in its own batch, every 5 s.)
    let arrived = |t: &Trace| {
        t.has("kvgate-router", "POST /v1/completions")
            && t.has("kvgate-prefill", "handoff_send")
            && t.spans().iter().any(|s| s.name == "handoff_receive" && s.is_error())
    };
    jaeger.wait_for(&trace_id, Duration::from_secs(30), arrived);
    let spans = run(&steps[1], &trace_id);
    for want in ["kvgate-router\tPOST /v1/completions", "kvgate-prefill\thandoff_send", "kvgate-decode\thandoff_receive\tchecksum"] {
        assert!(spans.lines().any(|l| l.starts_with(want)), "step 2 has no {want:?}:\n{spans}");
    }
    // 3. The router pod's access line: the client's request id and what it got.
    let line: Value = serde_json::from_str(run(&steps[2], &trace_id).lines().next().unwrap_or("null")).unwrap();
    assert_eq!((line["request_id"].as_str(), line["status"].as_u64()), (Some("walk-pods"), Some(502)), "{line}");
}

fn names_of(list: &Value) -> Vec<String> {
    list["items"].as_array().into_iter().flatten().filter_map(|o| o["metadata"]["name"].as_str().map(String::from)).collect()
}
