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

/// A tool `make tools` builds into target/tools/bin/.
fn tool(name: &str) -> PathBuf {
    let p = repo("target/tools/bin").join(name);
    assert!(p.is_file(), "{} not found: build it with `make tools` (make test does)", p.display());
    p
}

/// The checks charts/kvgate/README.md explains under "Findings left": (kube-score, checkov).
fn explained_findings() -> (Vec<String>, Vec<String>) {
    let readme = std::fs::read_to_string(repo("charts/kvgate/README.md")).unwrap();
    let (mut kube_score, mut checkov) = (Vec::new(), Vec::new());
    for line in readme.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() > 3 && cells[1].starts_with('`') {
            let id = cells[1].trim_matches('`').to_string();
            match cells[2] {
                "kube-score" => kube_score.push(id),
                "checkov" => checkov.push(id),
                _ => {}
            }
        }
    }
    assert!(!kube_score.is_empty() && !checkov.is_empty(), "no findings table in charts/kvgate/README.md");
    (kube_score, checkov)
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
        // The `helm test` pod is checked by kubeconform below and run by `helm test`; a dry run
        // of it alone would miss its ServiceAccount, which only exists once installed.
        let docs: Vec<Value> = render(values.as_deref(), &[]).into_iter().filter(|d| d["metadata"]["annotations"]["helm.sh/hook"].is_null()).collect();
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
    let schemas = cp.dir.join("schemas");
    let openapi: Value = serde_json::from_str(&cp.kubectl_ok(&["get", "--raw", "/openapi/v2"])).unwrap();
    assert!(support::schemas::write(&openapi, &schemas) > 100);
    for values in values_files() {
        let mut args = vec!["template".to_string(), "kvgate".into(), chart(), "-n".into(), "kvgate-system".into()];
        args.extend(values.iter().flat_map(|v| ["-f".to_string(), v.clone()]));
        let rendered = cp.dir.join("rendered.yaml");
        std::fs::write(&rendered, helm_ok(None, &args.iter().map(String::as_str).collect::<Vec<_>>())).unwrap();
        let which = values.as_deref().unwrap_or("the default values");
        let out = Command::new(tool("kubeconform"))
            .args(["-strict", "-summary", "-schema-location"])
            .arg(support::schemas::location(&schemas))
            .arg(&rendered)
            .output()
            .unwrap();
        assert!(out.status.success(), "kubeconform ({which}):\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let (kube_score, checkov) = explained_findings();
        let mut ks = Command::new(tool("kube-score"));
        ks.args(["score", "--output-format", "ci", "--exit-one-on-warning"]);
        for id in &kube_score {
            ks.args(["--ignore-test", id]);
        }
        let out = ks.arg(&rendered).output().unwrap();
        let findings: Vec<String> =
            String::from_utf8_lossy(&out.stdout).lines().filter(|l| !l.starts_with("[OK]") && !l.starts_with("[SKIPPED]")).map(String::from).collect();
        assert!(
            out.status.success() && findings.is_empty(),
            "kube-score ({which}) found what charts/kvgate/README.md does not explain:\n{}",
            findings.join("\n")
        );
        let out = Command::new(repo("target/pyenv/bin/checkov"))
            .args(["--framework", "kubernetes", "--compact", "--quiet", "--skip-download", "--skip-check", &checkov.join(","), "-f"])
            .arg(&rendered)
            .output()
            .expect("checkov not found in target/pyenv: run `make test-deps`");
        assert!(out.status.success(), "checkov ({which}) found what charts/kvgate/README.md does not explain:\n{}", String::from_utf8_lossy(&out.stdout));
    }
    // chart-testing's lint: helm lint, yamllint with its lintconf, yamale with its Chart.yaml schema.
    let path = format!("{}:{}:{}", repo("target/tools/bin").display(), repo("target/pyenv/bin").display(), std::env::var("PATH").unwrap_or_default());
    let out = Command::new(tool("ct"))
        .args(["lint", "--config"])
        .arg(repo("ct.yaml"))
        .current_dir(repo(""))
        .env("PATH", path)
        .env("CT_CONFIG_DIR", repo("target/tools/ct"))
        .output()
        .unwrap();
    assert!(out.status.success(), "ct lint:\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));

    // Typos in values fail (values.schema.json).
    let (ok, _, err) = helm(None, &["template", "kv", &chart(), "--set", "replicaCont=2"]);
    assert!(!ok && err.contains("replicaCont"), "{err}");
}

#[test]
fn the_chart_ships_the_generated_crds_rules_and_dashboards() {
    let same = |a: &str, b: &str| {
        assert_eq!(std::fs::read_to_string(repo(a)).unwrap(), std::fs::read_to_string(repo(b)).unwrap(), "{b} differs from {a}: run `make generate`")
    };
    same("crds/kvgate.dev_inferencedeployments.yaml", "charts/kvgate/files/crds/kvgate.dev_inferencedeployments.yaml");
    same("dashboards/alerts.yaml", "charts/kvgate/files/alerts.yaml");
    same("docs/runbooks.md", "charts/kvgate/files/runbooks.md");
    for d in ["integrity", "capacity", "serving", "operator"] {
        same(&format!("dashboards/{d}.json"), &format!("charts/kvgate/files/dashboards/{d}.json"));
    }
}

/// The alert rules link their runbooks where they are: the ConfigMap shipped beside them, or
/// the URL a platform team serves its copy at.
#[test]
fn every_alert_links_a_runbook_the_chart_ships_or_the_url_it_is_given() {
    let rules = |docs: &[Value]| -> Vec<Value> {
        let rule = docs.iter().find(|d| d["kind"] == "PrometheusRule").expect("a PrometheusRule");
        rule["spec"]["groups"].as_array().unwrap().iter().flat_map(|g| g["rules"].as_array().unwrap().clone()).filter(|r| r["alert"].is_string()).collect()
    };
    let docs = render(None, &["prometheusRule.enabled=true"]);
    let shipped = docs.iter().find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "kv-kvgate-runbooks").expect("the runbooks' ConfigMap");
    let runbooks = shipped["data"]["runbooks.md"].as_str().unwrap();
    let alerts = rules(&docs);
    assert!(alerts.len() >= 10, "{alerts:?}");
    for r in &alerts {
        let name = r["alert"].as_str().unwrap();
        assert!(runbooks.contains(&format!("\n## {name}\n")), "the shipped runbooks have no section for {name}");
        assert_eq!(r["annotations"]["runbook"], format!("ConfigMap kvgate-system/kv-kvgate-runbooks, key runbooks.md, section {name}"));
    }
    let served = rules(&render(None, &["prometheusRule.enabled=true", "prometheusRule.runbookBaseURL=https://runbooks.example/kvgate.md/"]));
    for r in &served {
        let name = r["alert"].as_str().unwrap();
        assert_eq!(r["annotations"]["runbook_url"], format!("https://runbooks.example/kvgate.md#{}", name.to_lowercase()));
        assert!(r["annotations"]["runbook"].is_null(), "{name}: one link, not two");
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
    assert!(!args.as_array().unwrap().iter().any(|a| a == "--cold-standby"), "standbys are warm by default: {args}");
    let cold = render(None, &["replicaCount=2", "coldStandby=true"]);
    let args = cold.iter().find(|d| d["kind"] == "Deployment").unwrap()["spec"]["template"]["spec"]["containers"][0]["args"].clone();
    assert!(args.as_array().unwrap().iter().any(|a| a == "--cold-standby"), "{args}");
}

#[test]
fn the_values_platform_teams_expect_render_as_documented() {
    let digest = format!("sha256:{}", "ab".repeat(32));
    let docs = render(
        None,
        &[
            &format!("image.digest={digest}"),
            "podLabels.team=llm",
            "priorityClassName=system-cluster-critical",
            "extraArgs[0]=--identity=$(POD_NAME)",
            "extraEnv[0].name=EXTRA",
            "extraEnv[0].value=on",
            "topologySpreadConstraints[0].maxSkew=1",
            "topologySpreadConstraints[0].topologyKey=kubernetes.io/hostname",
            "topologySpreadConstraints[0].whenUnsatisfiable=ScheduleAnyway",
            "podDisruptionBudget.enabled=true",
            "operatorNetworkPolicy.enabled=true",
            "fullnameOverride=kvg",
            "podSecurityContext.runAsUser=70000",
        ],
    );
    let dep = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    assert_eq!(dep["metadata"]["name"], "kvg");
    let pod = &dep["spec"]["template"];
    let c = &pod["spec"]["containers"][0];
    assert_eq!(c["image"], format!("ghcr.io/kvgate/kvgate-operator@{digest}"));
    assert_eq!(pod["metadata"]["labels"]["team"], "llm");
    assert_eq!(pod["spec"]["priorityClassName"], "system-cluster-critical");
    assert_eq!(pod["spec"]["securityContext"]["runAsUser"], 70000);
    assert!(c["args"].as_array().unwrap().iter().any(|a| a == "--identity=$(POD_NAME)"));
    assert!(c["env"].as_array().unwrap().iter().any(|e| e["name"] == "EXTRA" && e["value"] == "on"));
    let spread = &pod["spec"]["topologySpreadConstraints"][0];
    assert_eq!(spread["labelSelector"]["matchLabels"], dep["spec"]["selector"]["matchLabels"], "the spread selects the operator's pods");
    let pdb = docs.iter().find(|d| d["kind"] == "PodDisruptionBudget").unwrap();
    assert_eq!((&pdb["spec"]["minAvailable"], &pdb["spec"]["selector"]["matchLabels"]), (&serde_json::json!(1), &dep["spec"]["selector"]["matchLabels"]));
    let policy = docs.iter().find(|d| d["kind"] == "NetworkPolicy" && d["metadata"]["name"] == "kvg-operator").unwrap();
    assert_eq!(policy["spec"]["podSelector"]["matchLabels"], dep["spec"]["selector"]["matchLabels"]);
    assert!(policy["spec"]["ingress"].is_null() || policy["spec"]["ingress"].as_array().unwrap().is_empty(), "no metricsFrom: nothing may connect");
    // The CRD ships with the chart, kept on uninstall unless crds.keep=false; crds.enabled=false drops it.
    let crd = docs.iter().find(|d| d["kind"] == "CustomResourceDefinition").unwrap();
    assert_eq!(crd["metadata"]["annotations"]["helm.sh/resource-policy"], "keep");
    assert_eq!(
        crd["spec"],
        serde_yaml::from_str::<Value>(&std::fs::read_to_string(repo("crds/kvgate.dev_inferencedeployments.yaml")).unwrap()).unwrap()["spec"]
    );
    assert!(
        render(None, &["crds.keep=false"])
            .iter()
            .any(|d| d["kind"] == "CustomResourceDefinition" && d["metadata"]["annotations"]["helm.sh/resource-policy"].is_null())
    );
    assert!(!render(None, &["crds.enabled=false"]).iter().any(|d| d["kind"] == "CustomResourceDefinition"));
    // nameOverride names everything after it.
    assert!(render(None, &["nameOverride=gate"]).iter().any(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "kv-gate"));
    // A malformed digest is refused by the values schema, naming the field.
    let (ok, _, err) = helm(None, &["template", "kv", &chart(), "--set", "image.digest=latest"]);
    assert!(!ok && err.contains("digest"), "{err}");
}

/// One `registry` value moves every image the chart renders (the operator, the worker image it
/// gives InferenceDeployments, the `helm test` pod) to the registry `make push` filled.
#[test]
fn one_registry_value_points_every_image_at_your_registry() {
    let version = env!("CARGO_PKG_VERSION");
    let docs = render(None, &["registry=registry.example.com:5443/team/kvgate"]);
    let mut images: Vec<String> = Vec::new();
    for d in &docs {
        for c in d["spec"]["template"]["spec"]["containers"].as_array().into_iter().chain(d["spec"]["containers"].as_array()).flatten() {
            images.push(c["image"].as_str().unwrap().to_string());
            images.extend(c["args"].as_array().into_iter().flatten().filter_map(|a| a.as_str()?.strip_prefix("--worker-image=")).map(str::to_string));
        }
    }
    let want = [
        format!("registry.example.com:5443/team/kvgate/kvgate-operator:{version}"),
        format!("registry.example.com:5443/team/kvgate/kvgate-worker:{version}"),
        format!("registry.example.com:5443/team/kvgate/kvgate-operator:{version}"),
    ];
    assert_eq!(images.iter().collect::<BTreeSet<_>>(), want.iter().collect::<BTreeSet<_>>(), "every image: {images:?}");
    assert_eq!(images.len(), 3, "the operator, its worker image and the test pod: {images:?}");
    // A URL or a trailing slash is refused by the values schema, naming the value.
    for bad in ["https://registry.example.com/kvgate", "registry.example.com/kvgate/"] {
        let (ok, _, err) = helm(None, &["template", "kv", &chart(), "--set", &format!("registry={bad}")]);
        assert!(!ok && err.contains("registry"), "{bad}: {err}");
    }
}

type Rules = BTreeMap<(String, String), BTreeSet<String>>;

/// A role's rules without `resourceNames`, as (group, resource) -> verbs.
fn rules_of(role: &Value) -> Rules {
    let mut out = Rules::new();
    for r in role["rules"].as_array().unwrap().iter().filter(|r| r["resourceNames"].is_null()) {
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
        // The `helm test` pod has a Role of its own (list EndpointSlices); the operator's are the others.
        let docs: Vec<Value> = render(None, &set).into_iter().filter(|d| !d["metadata"]["name"].as_str().unwrap_or("").ends_with("-test")).collect();
        let watch = docs.iter().find(|d| d["kind"] == watch_kind && !d["metadata"]["name"].as_str().unwrap().ends_with("-leader-election")).unwrap();
        assert_eq!(rules_of(watch), expected(rbac::WATCHED_NAMESPACES), "{watch_kind} differs from operator/src/rbac.rs");
        let leader = docs.iter().find(|d| d["kind"] == "Role" && d["metadata"]["name"].as_str().unwrap().ends_with("-leader-election")).unwrap();
        assert_eq!(leader["metadata"]["namespace"], "kvgate-system");
        assert_eq!(rules_of(leader), expected(rbac::OWN_NAMESPACE));
        // The one Secret it may read: its root key, by name.
        let named: Vec<&Value> = leader["rules"].as_array().unwrap().iter().filter(|r| !r["resourceNames"].is_null()).collect();
        let (group, resource, verbs) = rbac::ROOT_KEY;
        assert_eq!(named.len(), 1, "{named:?}");
        assert_eq!((named[0]["apiGroups"][0].as_str(), named[0]["resources"][0].as_str()), (Some(group), Some(resource)));
        assert_eq!(named[0]["verbs"], serde_json::json!(verbs));
        assert_eq!(named[0]["resourceNames"], serde_json::json!(["kv-kvgate-root-key"]));
        let operator = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
        let args = operator["spec"]["template"]["spec"]["containers"][0]["args"].as_array().unwrap();
        assert!(args.iter().any(|a| a == "--root-key-secret=kv-kvgate-root-key"), "{args:?}");
        // Nowhere may it get, list or watch Secrets beyond that one.
        for role in docs.iter().filter(|d| d["kind"] == "Role" || d["kind"] == "ClusterRole") {
            let secrets = rules_of(role).get(&(String::new(), "secrets".to_string())).cloned().unwrap_or_default();
            assert!(secrets.iter().all(|v| v == "create"), "{} may {secrets:?} Secrets", role["metadata"]["name"]);
        }
        let cluster_scoped: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "ClusterRole").collect();
        assert_eq!(cluster_scoped.len(), usize::from(watch_kind == "ClusterRole"), "nothing cluster-wide when one namespace is watched");
    }
}

/// `scripts/push.sh` (what `make push` runs) with the test images: the operator and worker images
/// and the chart to the world's registry; the chart's version.
fn push_to_the_worlds_registry() -> String {
    kvgate_testenv::registry::shared().unwrap();
    let out = Command::new("bash")
        .arg(repo("scripts/push.sh"))
        .arg(format!("{}/kvgate", kvgate_testenv::registry::local()))
        .arg("--from")
        .arg(kvgate_testenv::images::debug_layouts().unwrap())
        .arg("--insecure")
        .env("HELM", helm_bin())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "scripts/push.sh failed:\n{said}\n{}", String::from_utf8_lossy(&out.stderr));
    let chart: Value = serde_yaml::from_str(&std::fs::read_to_string(repo("charts/kvgate/Chart.yaml")).unwrap()).unwrap();
    let version = chart["version"].as_str().unwrap().to_string();
    for pushed in ["kvgate-operator:", "kvgate-worker:", &format!("charts/kvgate:{version}")] {
        assert!(said.lines().any(|l| l.starts_with("pushed ") && l.contains(pushed)), "push.sh said:\n{said}");
    }
    version
}

#[test]
fn helm_install_runs_the_operator_under_its_own_service_account_and_uninstall_cleans_up() {
    let cp = cluster();
    let release_ns = cp.restricted_namespace("kvgate-system");
    let chart = chart();
    // As on a cluster of your own: `make push` to a registry, the chart installed from it, and
    // every image it renders pulled from it by the nodes (plain HTTP: the world's registry).
    let chart_version = push_to_the_worlds_registry();
    let registry = format!("{}/kvgate", kvgate_testenv::registry::host());
    let from_registry = format!("oci://{}/kvgate/charts/kvgate", kvgate_testenv::registry::local());
    // The CRD was applied from crds/ (as the other tests need it): adopt it as the chart README's
    // upgrade notes say, so the release owns (and upgrades) it from now on.
    let crd = "crd/inferencedeployments.kvgate.dev";
    cp.kubectl_ok(&["label", crd, "app.kubernetes.io/managed-by=Helm", "--overwrite"]);
    cp.kubectl_ok(&["annotate", crd, "meta.helm.sh/release-name=kvgate", &format!("meta.helm.sh/release-namespace={release_ns}"), "--overwrite"]);
    let (ok, notes, warnings) = helm(
        Some(cp),
        &[
            "install",
            "kvgate",
            &from_registry,
            "--version",
            &chart_version,
            "--plain-http",
            "--set",
            &format!("registry={registry}"),
            "-n",
            &release_ns,
            "--wait",
            "--timeout",
            "120s",
        ],
    );
    assert!(ok, "helm install failed:\n{notes}\n{warnings}");
    // A clean install: nothing in the chart (the CRD's schema formats included) makes the API
    // server or helm warn.
    assert!(!warnings.contains("Warning") && !notes.contains("Warning") && !warnings.contains("WARN"), "helm install warned:\n{warnings}\n{notes}");
    let version = env!("CARGO_PKG_VERSION");
    let op = get_json(cp, &["-n", &release_ns, "get", "pods", "-l", "app.kubernetes.io/name=kvgate-operator"])["items"][0].clone();
    assert_eq!(op["spec"]["containers"][0]["image"], format!("{registry}/kvgate-operator:{version}"));
    let pulled = op["status"]["containerStatuses"][0]["imageID"].as_str().unwrap_or_default().to_string();
    assert!(pulled.starts_with(&format!("{registry}/kvgate-operator@sha256:")), "the operator's image was pulled from the registry: imageID {pulled}");
    let owned = get_json(cp, &["get", crd]);
    assert_eq!(owned["metadata"]["annotations"]["helm.sh/resource-policy"], "keep", "{}", owned["metadata"]);
    // `helm test`: the operator image's `check` finds the operator pods through the Service's
    // EndpointSlices and gets 200 from /readyz, running as a restricted pod under its own identity.
    let out = helm_ok(Some(cp), &["test", "kvgate", "-n", &release_ns, "--timeout", "120s"]);
    assert!(out.contains("kvgate-test-ready") && out.contains("Succeeded"), "{out}");
    let ns = cp.restricted_namespace("demo");
    // The NOTES' example is whole in the NOTES (a user of the chart may have no clone): the
    // lines between `<<'EOF'` and `EOF`, applied as they stand.
    assert!(!notes.contains("https://"), "the NOTES point at nothing a user of the chart may lack:\n{notes}");
    let example: Vec<&str> = notes.lines().skip_while(|l| !l.ends_with("<<'EOF'")).skip(1).take_while(|l| *l != "EOF").collect();
    assert!(example.iter().any(|l| l.contains("kind: InferenceDeployment")), "no example in the NOTES:\n{notes}");
    let file = std::env::temp_dir().join(format!("kvgate-notes-{}.yaml", std::process::id()));
    std::fs::write(&file, example.join("\n")).unwrap();
    cp.kubectl_ok(&["-n", &ns, "apply", "-f", file.to_str().unwrap(), "-f", repo("examples/incident.yaml").to_str().unwrap()]);
    std::fs::remove_file(&file).unwrap();
    eventually(cp, &ns, "tiny Available and incident Refused by the chart's operator", Duration::from_secs(180), || {
        infd(cp, &ns, "tiny")["status"]["phase"] == "Available" && infd(cp, &ns, "incident")["status"]["phase"] == "Refused"
    });
    // Its workers run the worker image the chart named, pulled from the same registry.
    let workers = get_json(cp, &["-n", &ns, "get", "pods", "-l", "app.kubernetes.io/instance=tiny"]);
    let ids: Vec<&str> = workers["items"].as_array().unwrap().iter().filter_map(|p| p["status"]["containerStatuses"][0]["imageID"].as_str()).collect();
    assert!(!ids.is_empty() && ids.iter().all(|id| id.starts_with(&format!("{registry}/kvgate-worker@sha256:"))), "{ids:?}");
    // The README's next step: `kubectl port-forward svc/tiny`, and a completion through it.
    // A forwarded connection that fails ends kubectl's port-forward: each try starts one.
    let (mut forward, mut answer) = (None, None);
    eventually(cp, &ns, "a completion through kubectl port-forward svc/tiny", Duration::from_secs(60), || {
        let Ok(f) = cp.port_forward(&ns, "svc/tiny", 80) else { return false };
        answer = kvgate_testenv::http::request("POST", &format!("http://{}/v1/completions", f.local), Some(r#"{"prompt":"Hello","max_tokens":8}"#));
        forward = Some(f);
        answer.as_ref().is_some_and(|(status, _)| *status == 200)
    });
    let (forward, (_, body)) = (forward.unwrap(), answer.unwrap());
    assert!(serde_json::from_str::<Value>(&body).unwrap()["choices"][0]["text"].is_string(), "{body}\nkubectl said: {}", forward.stderr());
    // `kubectl kvgate check` through the same forward, as from a laptop: the gate's verdict.
    let plugin = std::path::Path::new(env!("CARGO_BIN_EXE_kubectl-kvgate"));
    let out = Command::new(kvgate_testenv::controlplane::kubectl_path())
        .args(["kvgate", "check", &format!("http://{}", forward.local), "--engine", "kvgate", "--window", "2048"])
        .env("PATH", format!("{}:{}", plugin.parent().unwrap().display(), std::env::var("PATH").unwrap_or_default()))
        .output()
        .unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && said.contains("passed: kvgate server"), "kubectl kvgate check through port-forward:\n{said}");
    drop(forward);
    let msg = condition(&infd(cp, &ns, "incident"), "RolloutRefused").unwrap()["message"].as_str().unwrap().to_string();
    assert!(msg.contains("tokens < contextWindow 1048576"), "{msg}");
    // examples/llamacpp.yaml as it stands, on the chart's defaults (no host path allowed, a
    // restricted namespace): its claim `models` bound to a directory holding a tiny GGUF, it
    // reaches what its first comment promises, llama.cpp's own numbers refusing the window.
    let models = cp.dir.join("chart-models");
    kvgate_testenv::models::write(kvgate_testenv::models::Format::Gguf, &models.join("tiny.gguf"));
    let claim = format!(
        "apiVersion: v1\nkind: PersistentVolume\nmetadata: {{ name: {ns}-models }}\nspec:\n  capacity: {{ storage: 1Gi }}\n  accessModes: [ReadOnlyMany]\n  storageClassName: \"\"\n  hostPath: {{ path: {dir}, type: Directory }}\n  claimRef: {{ namespace: {ns}, name: models }}\n---\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{ name: models }}\nspec:\n  accessModes: [ReadOnlyMany]\n  storageClassName: \"\"\n  resources: {{ requests: {{ storage: 1Gi }} }}\n",
        dir = models.display()
    );
    apply_yaml(cp, &ns, &claim);
    let example = std::fs::read_to_string(repo("examples/llamacpp.yaml")).unwrap();
    assert!(example.contains(&format!("image: {}\n", kvgate_testenv::images::llamacpp())), "the example names the test world's llama.cpp image");
    apply_yaml(cp, &ns, &example);
    eventually(cp, &ns, "examples/llamacpp.yaml Refused with llama.cpp's numbers", Duration::from_secs(180), || {
        infd(cp, &ns, "llamacpp")["status"]["phase"] == "Refused"
    });
    let msg = condition(&infd(cp, &ns, "llamacpp"), "RolloutRefused").unwrap()["message"].as_str().unwrap().to_string();
    let promised = example.lines().find(|l| l.starts_with("#   RolloutRefused: ")).unwrap().rsplit(": ").next().unwrap().to_string();
    assert!(msg.contains(&promised), "the example promises {promised:?}; the operator said {msg}");
    // The chart's permissions cover the optional gateway pool: created under the operator's own
    // identity once the Gateway API Inference Extension's CRD is there.
    cp.kubectl_ok(&["apply", "-f", repo("tests/fixtures/inferencepool-crd.yaml").to_str().unwrap()]);
    cp.kubectl_ok(&["wait", "--for=condition=Established", "crd/inferencepools.inference.networking.k8s.io", "--timeout=30s"]);
    cp.kubectl_ok(&["-n", &ns, "patch", "infd", "tiny", "--type=merge", "-p", r#"{"spec":{"inferencePool":{"endpointPicker":{"name":"tiny-epp"}}}}"#]);
    eventually(cp, &ns, "the InferencePool applied by the chart's operator", Duration::from_secs(90), || {
        condition_true(&infd(cp, &ns, "tiny"), "InferencePoolReady")
            && get_json(cp, &["-n", &ns, "get", "inferencepools.inference.networking.k8s.io", "tiny"])["spec"]["endpointPickerRef"]["name"] == "tiny-epp"
    });
    // The events were written by the pod's identity: its ServiceAccount, not an admin.
    let op = get_json(cp, &["-n", &release_ns, "get", "pods", "-l", "app.kubernetes.io/name=kvgate-operator"]);
    assert_eq!(op["items"][0]["spec"]["serviceAccountName"], "kvgate");

    // Upgrade to two replicas: leader election on, one leader.
    helm_ok(Some(cp), &["upgrade", "kvgate", &chart, "-n", &release_ns, "--reuse-values", "--set", "replicaCount=2", "--wait", "--timeout", "120s"]);
    eventually(cp, &release_ns, "two operator pods and a Lease", Duration::from_secs(120), || {
        let pods = get_json(cp, &["-n", &release_ns, "get", "pods", "-l", "app.kubernetes.io/name=kvgate-operator"]);
        let lease = get_json(cp, &["-n", &release_ns, "get", "lease", "kvgate"]);
        pods["items"].as_array().is_some_and(|a| a.len() == 2 && a.iter().all(|p| condition_true(p, "Ready"))) && lease["spec"]["holderIdentity"].is_string()
    });

    // With no operator pod ready, `helm test` fails and says why.
    cp.kubectl_ok(&["-n", &release_ns, "scale", "deployment/kvgate", "--replicas=0"]);
    eventually(cp, &release_ns, "no operator pod left", Duration::from_secs(60), || {
        get_json(cp, &["-n", &release_ns, "get", "pods", "-l", "app.kubernetes.io/name=kvgate-operator"])["items"].as_array().is_some_and(Vec::is_empty)
    });
    let (ok, out, err) = helm(Some(cp), &["test", "kvgate", "-n", &release_ns, "--timeout", "60s"]);
    let log = cp.kubectl(&["-n", &release_ns, "logs", "kvgate-test-ready"]);
    let log = String::from_utf8_lossy(&log.stdout);
    assert!(!ok && log.contains("has no ready endpoint with a port named metrics"), "{out}\n{err}\n{log}");
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
