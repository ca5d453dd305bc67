//! One contract between the operator and the worker: for specs at every bound the CRD allows,
//! the arguments the operator renders for each role pass the worker's own parser
//! (`kvgate-worker --check-config`), and the CRD's bounds are the worker's.

mod support;

use std::process::Command;

use kvgate_operator::crd::InferenceDeployment;
use kvgate_operator::gate::Role;
use kvgate_operator::render::{router, workers};
use kvgate_proto::contract;
use kvgate_telemetry::LogFormat;
use serde_json::{Value, json};
use support::*;

fn spec(context_window: u64, pool: Value, model: Value, timeout_ms: u64) -> InferenceDeployment {
    let spec = json!({
        "model": model, "contextWindow": context_window,
        "prefill": { "replicas": 1, "kvPool": pool }, "decode": { "replicas": 1, "kvPool": pool },
        "handoff": { "timeoutMs": timeout_ms },
    });
    let mut d = InferenceDeployment::new("llm", serde_json::from_value(spec).unwrap());
    d.metadata.namespace = Some("ns".into());
    d.metadata.uid = Some("uid-1".into());
    d
}

/// Every bound of the CRD's schema that reaches a worker flag, one spec each.
fn boundary_specs() -> Vec<InferenceDeployment> {
    let tiny = json!({ "name": "tiny" });
    let mut out = Vec::new();
    for page in contract::PAGE_SIZES {
        out.push(spec(1, json!({ "pageSize": page }), tiny.clone(), 30_000));
    }
    for pool in [
        json!({ "tokens": 1 }),
        json!({ "tokens": u32::MAX }),
        json!({ "bytes": 1 }),
        json!({ "bytes": 1u64 << 40 }),
        json!({ "memoryFraction": "1" }),
        json!({ "memoryFraction": "1." }),
        json!({ "memoryFraction": "1.000" }),
        json!({ "memoryFraction": ".000001" }),
        json!({ "memoryFraction": "0.5" }),
        json!({ "dtype": "f32" }),
        json!({ "dtype": "f16" }),
        json!({ "dtype": "bf16" }),
        json!({ "dtype": "q8_0" }),
        json!({ "device": "cuda" }),
        json!({ "device": "cuda:7" }),
    ] {
        out.push(spec(2048, pool, tiny.clone(), 30_000));
    }
    out.push(spec(1 << 53, json!({}), tiny.clone(), 100));
    out.push(spec(1 << 20, json!({}), tiny.clone(), 600_000));
    out.push(spec(4096, json!({}), json!({ "path": "llama/3.2-1b", "volume": { "persistentVolumeClaim": "models" } }), 30_000));
    // Every field of spec.auth at once, each at its bounds.
    let mut auth = spec(2048, json!({}), tiny, 30_000);
    auth.spec.auth = Some(
        serde_json::from_value(json!({
            "apiKeysSecret": "k".repeat(253),
            "trustedProxy": { "header": "x-tenant", "sourceRanges": ["10.0.0.0/8", "fd00::/8", "192.168.1.7/32"] },
            "tokensPerMinute": 1,
            "tenants": [{ "name": "a", "tokensPerMinute": u64::MAX }, { "name": format!("t.{}_-", "x".repeat(59)), "tokensPerMinute": 1 }],
        }))
        .unwrap(),
    );
    out.push(auth);
    out
}

/// Runs one rendered argument list through `kvgate-worker --check-config` (the kubelet would
/// expand `$(POD_IP)`).
fn check(args: &[String]) -> Result<(), String> {
    let args: Vec<String> = args.iter().map(|a| a.replace("$(POD_IP)", "10.0.0.7")).collect();
    let out = Command::new(workspace_bin("kvgate-worker")).arg("--check-config").args(&args).env_remove("KVGATE_HANDOFF_SECRET_FILE").output().unwrap();
    if out.status.success() { Ok(()) } else { Err(format!("{args:?}: {}", String::from_utf8_lossy(&out.stderr))) }
}

#[test]
fn every_spec_at_the_crds_bounds_renders_arguments_the_worker_accepts() {
    let mut failed = Vec::new();
    for d in boundary_specs() {
        for log in [LogFormat::Text, LogFormat::Json] {
            for role in [Role::Prefill, Role::Decode] {
                failed.extend(check(&workers::worker_args(&d, role, &workers::Telemetry::logging(log))).err());
            }
            let dep = router::deployment(&d, "img", d.spec.context_window, &workers::Telemetry::logging(log));
            let args = dep.spec.template.spec.unwrap().containers[0].args.clone().unwrap();
            failed.extend(check(&args).err());
        }
    }
    assert!(failed.is_empty(), "the worker refuses what the operator renders:\n{}", failed.join("\n"));
}

#[test]
fn the_worker_refuses_what_the_crd_refuses() {
    let d = spec(2048, json!({}), json!({ "name": "tiny" }), 30_000);
    let args = workers::worker_args(&d, Role::Decode, &workers::Telemetry::logging(LogFormat::Json));
    let with = |flag: &str, value: &str| -> Vec<String> {
        let mut a: Vec<String> = args.iter().filter(|x| !x.starts_with(&format!("--{flag}="))).cloned().collect();
        a.push(contract::flag::arg(flag, value));
        a
    };
    assert_eq!(check(&args), Ok(()));
    for (flag, value) in [
        (contract::flag::PAGE_SIZE, "2048"),
        (contract::flag::PAGE_SIZE, "24"),
        (contract::flag::KV_MEMORY_FRACTION, "0"),
        (contract::flag::KV_MEMORY_FRACTION, "1.5"),
        (contract::flag::KV_DTYPE, "f64"),
        (contract::flag::DEVICE, "tpu"),
        (contract::flag::CONTEXT_WINDOW, "0"),
        (contract::flag::KV_POOL_TOKENS, "0"),
        (contract::flag::LOG_FORMAT, "yaml"),
    ] {
        let err = check(&with(flag, value)).expect_err(&format!("--{flag}={value} accepted"));
        assert!(err.contains(flag), "the error does not name --{flag}: {err}");
    }
    // Without the secret file flag the role would not start either.
    let without: Vec<String> = args.iter().filter(|x| !x.starts_with("--handoff-secret-file")).cloned().collect();
    assert!(check(&without).unwrap_err().contains("--handoff-secret-file"));
}

#[test]
fn the_crds_page_size_rule_is_the_contracts() {
    let crd = std::fs::read_to_string(repo(kvgate_operator::crdgen::FILE)).unwrap();
    assert!(crd.contains(contract::PAGE_SIZE_RULE), "crds/ does not carry {:?}", contract::PAGE_SIZE_RULE);
    assert!(!crd.contains("2048, 4096"), "crds/ still allows pages the worker refuses");
}
