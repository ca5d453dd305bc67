//! The Helm chart with the real `helm` client (built by `make tools`): lint, render with every
//! values file, validate the manifests on the test API server, RBAC equal to what the operator
//! uses, and an install whose operator runs as a pod under the chart's own ServiceAccount.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use kvgate_operator::rbac;
use kvgate_testenv::ControlPlane;
use serde_json::Value;
use support::*;

fn helm_bin() -> PathBuf {
    let p = repo("target/tools/bin/helm");
    assert!(p.is_file(), "{} not found: build it with `make tools` (make test does)", p.display());
    p
}

/// Runs helm; (success, stdout, stderr).
fn helm(cp: Option<&ControlPlane>, args: &[&str]) -> (bool, String, String) {
    let mut cmd = Command::new(helm_bin());
    if let Some(cp) = cp {
        cmd.arg(format!("--kubeconfig={}", cp.kubeconfig.display()));
    }
    let out = cmd.args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn helm_ok(cp: Option<&ControlPlane>, args: &[&str]) -> String {
    let (ok, out, err) = helm(cp, args);
    assert!(ok, "helm {args:?} failed:\n{out}\n{err}");
    out
}

fn chart() -> String {
    repo("charts/kvgate").display().to_string()
}

fn values_files() -> Vec<Option<String>> {
    let mut v = vec![None];
    for e in std::fs::read_dir(repo("charts/kvgate/ci")).unwrap() {
        v.push(Some(e.unwrap().path().display().to_string()));
    }
    v
}

fn render(values: Option<&str>, set: &[&str]) -> Vec<Value> {
    let chart = chart();
    // No --kube-version: helm is built knowing the Kubernetes it was built with (tests/tools/build.sh).
    let mut args = vec!["template", "kv", &chart, "-n", "kvgate-system"];
    if let Some(v) = values {
        args.extend(["-f", v]);
    }
    for s in set {
        args.extend(["--set", s]);
    }
    let text = helm_ok(None, &args);
    text.split("\n---").filter_map(|doc| serde_yaml::from_str::<Value>(doc).ok()).filter(|v| v.is_object()).collect()
}

#[test]
fn the_chart_lints_renders_and_validates_on_the_api_server() {
    let cp = cluster();
    cp.kubectl_ok(&["apply", "-f", repo("tests/fixtures/monitoring-crds.yaml").to_str().unwrap()]);
    cp.kubectl_ok(&[
        "wait",
        "--for=condition=Established",
        "crd/servicemonitors.monitoring.coreos.com",
        "crd/podmonitors.monitoring.coreos.com",
        "crd/prometheusrules.monitoring.coreos.com",
        "--timeout=30s",
    ]);
    for ns in ["kvgate-system", "llm"] {
        let _ = cp.kubectl(&["create", "namespace", ns]);
    }
    for values in values_files() {
        let mut args = vec!["lint".to_string(), "--strict".to_string(), chart()];
        args.extend(values.iter().flat_map(|v| ["-f".to_string(), v.clone()]));
        helm_ok(None, &args.iter().map(String::as_str).collect::<Vec<_>>());
        let docs = render(values.as_deref(), &[]);
        assert!(!docs.is_empty());
        let path = cp.dir.join(format!("rendered-{}.json", docs.len()));
        std::fs::write(&path, serde_json::to_string(&serde_json::json!({ "apiVersion": "v1", "kind": "List", "items": docs })).unwrap()).unwrap();
        cp.kubectl_ok(&["apply", "--dry-run=server", "-f", path.to_str().unwrap()]);
        for d in &docs {
            let labels = &d["metadata"]["labels"];
            for l in ["app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version", "app.kubernetes.io/managed-by", "helm.sh/chart"] {
                assert!(labels[l].is_string(), "{} {} lacks label {l}", d["kind"], d["metadata"]["name"]);
            }
        }
    }
    // Typos in values fail (values.schema.json).
    let (ok, _, err) = helm(None, &["template", "kv", &chart(), "--set", "replicaCont=2"]);
    assert!(!ok && err.contains("replicaCont"), "{err}");
}

#[test]
fn the_chart_ships_the_generated_crds_rules_and_dashboards() {
    let same = |a: &str, b: &str| {
        assert_eq!(std::fs::read_to_string(repo(a)).unwrap(), std::fs::read_to_string(repo(b)).unwrap(), "{b} differs from {a}: run `make generate`")
    };
    same("crds/kvgate.dev_inferencedeployments.yaml", "charts/kvgate/crds/kvgate.dev_inferencedeployments.yaml");
    same("dashboards/alerts.yaml", "charts/kvgate/files/alerts.yaml");
    for d in ["integrity", "capacity", "serving", "operator"] {
        same(&format!("dashboards/{d}.json"), &format!("charts/kvgate/files/dashboards/{d}.json"));
    }
}

#[test]
fn the_operator_deployment_is_locked_down_and_tags_default_to_the_app_version() {
    let docs = render(None, &[]);
    let dep = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    let pod = &dep["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["securityContext"]["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert!(c["resources"]["requests"].is_object() && c["livenessProbe"].is_object() && c["readinessProbe"].is_object());
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(c["image"], format!("ghcr.io/kvgate/kvgate-operator:{version}"));
    let args: Vec<&str> = c["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    assert!(args.contains(&format!("--worker-image=ghcr.io/kvgate/kvgate-worker:{version}").as_str()), "{args:?}");
    assert!(!args.contains(&"--leader-elect"), "one replica needs no election");
    let two = render(None, &["replicaCount=2"]);
    let args = two.iter().find(|d| d["kind"] == "Deployment").unwrap()["spec"]["template"]["spec"]["containers"][0]["args"].clone();
    assert!(args.as_array().unwrap().iter().any(|a| a == "--leader-elect"), "{args}");
}

type Rules = BTreeMap<(String, String), BTreeSet<String>>;

fn rules_of(role: &Value) -> Rules {
    let mut out = Rules::new();
    for r in role["rules"].as_array().unwrap() {
        for g in r["apiGroups"].as_array().unwrap() {
            for res in r["resources"].as_array().unwrap() {
                let verbs = r["verbs"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string());
                out.entry((g.as_str().unwrap().to_string(), res.as_str().unwrap().to_string())).or_default().extend(verbs);
            }
        }
    }
    out
}

fn expected(list: &[(&str, &str, &[&str])]) -> Rules {
    list.iter().map(|(g, r, v)| ((g.to_string(), r.to_string()), v.iter().map(|s| s.to_string()).collect())).collect()
}

#[test]
fn the_chart_grants_exactly_the_permissions_the_operator_uses() {
    for (set, watch_kind) in [(vec![], "ClusterRole"), (vec!["watchNamespace=llm"], "Role")] {
        let docs = render(None, &set);
        let watch = docs.iter().find(|d| d["kind"] == watch_kind && !d["metadata"]["name"].as_str().unwrap().ends_with("-leader-election")).unwrap();
        assert_eq!(rules_of(watch), expected(rbac::WATCHED_NAMESPACES), "{watch_kind} differs from operator/src/rbac.rs");
        let leader = docs.iter().find(|d| d["kind"] == "Role" && d["metadata"]["name"].as_str().unwrap().ends_with("-leader-election")).unwrap();
        assert_eq!(leader["metadata"]["namespace"], "kvgate-system");
        assert_eq!(rules_of(leader), expected(rbac::OWN_NAMESPACE));
        let cluster_scoped: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "ClusterRole").collect();
        assert_eq!(cluster_scoped.len(), usize::from(watch_kind == "ClusterRole"), "nothing cluster-wide when one namespace is watched");
    }
}

#[test]
fn helm_install_runs_the_operator_under_its_own_service_account_and_uninstall_cleans_up() {
    let cp = cluster();
    let release_ns = cp.restricted_namespace("kvgate-system");
    let chart = chart();
    helm_ok(Some(cp), &["install", "kvgate", &chart, "-n", &release_ns, "--wait", "--timeout", "120s"]);
    let ns = cp.restricted_namespace("demo");
    cp.kubectl_ok(&["-n", &ns, "apply", "-f", repo("examples/tiny.yaml").to_str().unwrap(), "-f", repo("examples/incident.yaml").to_str().unwrap()]);
    eventually(cp, &ns, "tiny Available and incident Refused by the chart's operator", Duration::from_secs(180), || {
        infd(cp, &ns, "tiny")["status"]["phase"] == "Available" && infd(cp, &ns, "incident")["status"]["phase"] == "Refused"
    });
    let msg = condition(&infd(cp, &ns, "incident"), "RolloutRefused").unwrap()["message"].as_str().unwrap().to_string();
    assert!(msg.contains("tokens < contextWindow 1048576"), "{msg}");
    // The events were written by the pod's identity: its ServiceAccount, not an admin.
    let op = get_json(cp, &["-n", &release_ns, "get", "pods", "-l", "app.kubernetes.io/name=kvgate-operator"]);
    assert_eq!(op["items"][0]["spec"]["serviceAccountName"], "kvgate");

    // Upgrade to two replicas: leader election on, one leader.
    helm_ok(Some(cp), &["upgrade", "kvgate", &chart, "-n", &release_ns, "--set", "replicaCount=2", "--wait", "--timeout", "120s"]);
    eventually(cp, &release_ns, "two operator pods and a Lease", Duration::from_secs(120), || {
        let pods = get_json(cp, &["-n", &release_ns, "get", "pods", "-l", "app.kubernetes.io/name=kvgate-operator"]);
        let lease = get_json(cp, &["-n", &release_ns, "get", "lease", "kvgate"]);
        pods["items"].as_array().is_some_and(|a| a.len() == 2 && a.iter().all(|p| condition_true(p, "Ready"))) && lease["spec"]["holderIdentity"].is_string()
    });

    helm_ok(Some(cp), &["uninstall", "kvgate", "-n", &release_ns, "--wait", "--timeout", "60s"]);
    let left = cp.kubectl_ok(&["get", "clusterroles,clusterrolebindings", "-l", "app.kubernetes.io/instance=kvgate", "-o", "name"]);
    assert!(left.trim().is_empty(), "left behind: {left}");
    let left = cp.kubectl_ok(&[
        "-n",
        &release_ns,
        "get",
        "deployments,services,serviceaccounts,roles,rolebindings,configmaps",
        "-l",
        "app.kubernetes.io/instance=kvgate",
        "-o",
        "name",
    ]);
    assert!(left.trim().is_empty(), "left behind: {left}");
    // Helm's rule: CRDs stay (deleting them would delete every InferenceDeployment).
    cp.kubectl_ok(&["get", "crd", "inferencedeployments.kvgate.dev"]);
}
