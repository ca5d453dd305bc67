//! JSON schemas for kubeconform from a live API server's `/openapi/v2`, as kubeconform's own
//! schema repository is made (openapi2jsonschema, "standalone-strict"): one file per kind with
//! every definition it refers to, objects closed to unknown fields, int-or-string as either. The
//! test API server knows exactly the Kubernetes version and the CRDs the chart is checked against,
//! and nothing has to be downloaded.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::{Map, Value, json};

/// kubeconform's `-schema-location` for files written by `write`.
pub fn location(dir: &Path) -> String {
    format!("{}/{{{{ .ResourceKind }}}}_{{{{ .Group }}}}_{{{{ .ResourceAPIVersion }}}}.json", dir.display())
}

/// Rewrites one schema in place: int-or-string, and unknown fields refused where properties are
/// listed (strict).
fn strict(schema: &mut Value) {
    match schema {
        Value::Object(map) => {
            if map.get("format").and_then(Value::as_str) == Some("int-or-string") {
                *schema = json!({ "oneOf": [{ "type": "string" }, { "type": "integer" }] });
                return;
            }
            if map.contains_key("properties") && !map.contains_key("additionalProperties") {
                map.insert("additionalProperties".into(), Value::Bool(false));
            }
            for v in map.values_mut() {
                strict(v);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(strict),
        _ => {}
    }
}

fn refs(schema: &Value, out: &mut Vec<String>) {
    match schema {
        Value::Object(map) => {
            if let Some(r) = map.get("$ref").and_then(Value::as_str).and_then(|r| r.strip_prefix("#/definitions/")) {
                out.push(r.to_string());
            }
            map.values().for_each(|v| refs(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
        _ => {}
    }
}

/// Writes one schema file per group/version/kind of `openapi` (an `/openapi/v2` document) into
/// `dir`; returns how many.
pub fn write(openapi: &Value, dir: &Path) -> usize {
    std::fs::create_dir_all(dir).unwrap();
    let definitions = openapi["definitions"].as_object().expect("/openapi/v2 has definitions");
    let mut written = 0;
    for (name, def) in definitions {
        for gvk in def["x-kubernetes-group-version-kind"].as_array().into_iter().flatten() {
            let (group, version, kind) = (gvk["group"].as_str().unwrap_or(""), gvk["version"].as_str().unwrap_or(""), gvk["kind"].as_str().unwrap_or(""));
            // Every definition reachable from this one, so the file stands alone.
            let mut needed = BTreeSet::new();
            let mut todo = vec![name.clone()];
            while let Some(n) = todo.pop() {
                if needed.insert(n.clone())
                    && let Some(d) = definitions.get(&n)
                {
                    refs(d, &mut todo);
                }
            }
            let mut schema = def.clone();
            let defs: Map<String, Value> = needed.iter().filter_map(|n| definitions.get(n).map(|d| (n.clone(), d.clone()))).collect();
            schema["definitions"] = Value::Object(defs);
            strict(&mut schema);
            // kubeconform's template: Group is the first part of apiVersion ("v1" for the core group).
            let group_part = if group.is_empty() { version } else { group };
            let file = dir.join(format!("{}_{}_{}.json", kind.to_lowercase(), group_part, version));
            std::fs::write(file, schema.to_string()).unwrap();
            written += 1;
        }
    }
    written
}
