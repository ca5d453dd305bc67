//! `crds/` is what `kvgate-operator crd` prints: regenerate with
//! `make generate` (which also writes the chart's copy).

#[test]
fn crds_dir_is_not_stale() {
    let want = kvgate_operator::crdgen::yaml().unwrap();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(kvgate_operator::crdgen::FILE);
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(have == want, "{} is stale: run `make generate`", path.display());
}

#[test]
fn the_binary_prints_the_same_crds() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate-operator")).arg("crd").output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), kvgate_operator::crdgen::yaml().unwrap());
}

/// What `kubectl explain` shows: a real description of the kind, every status field described,
/// `conditions` a list-map keyed by `type`, and closed sets as enums.
#[test]
fn the_crd_reads_well_in_kubectl_explain() {
    let yaml = kvgate_operator::crdgen::yaml().unwrap();
    let crd: serde_json::Value = serde_yaml::from_str(&yaml).unwrap();
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let kind = schema["description"].as_str().unwrap();
    assert!(kind.starts_with("A disaggregated LLM deployment") && !kind.contains("Auto-generated"), "{kind}");
    fn undocumented(path: &str, s: &serde_json::Value, out: &mut Vec<String>) {
        for (name, p) in s["properties"].as_object().into_iter().flatten() {
            let here = format!("{path}.{name}");
            if p["description"].as_str().is_none_or(str::is_empty) {
                out.push(here.clone());
            }
            undocumented(&here, p, out);
            undocumented(&here, &p["items"], out);
        }
    }
    let mut missing = Vec::new();
    undocumented("status", &schema["properties"]["status"], &mut missing);
    assert!(missing.is_empty(), "status fields without a description: {missing:?}");
    let conditions = &schema["properties"]["status"]["properties"]["conditions"];
    assert_eq!((conditions["x-kubernetes-list-type"].as_str(), conditions["x-kubernetes-list-map-keys"][0].as_str()), (Some("map"), Some("type")));
    let dtype = &schema["properties"]["spec"]["properties"]["prefill"]["properties"]["kvPool"]["properties"]["dtype"];
    assert_eq!(dtype["enum"], serde_json::json!(["f32", "f16", "bf16", "q8_0"]));
}
