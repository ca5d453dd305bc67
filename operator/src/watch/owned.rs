//! What an owned object holds of what this operator applied, in eight bytes. The API server
//! records, per field manager, the fields each one set (`managedFields`, FieldsV1). The watch
//! projects every object it sees onto the fields this operator's applies own, digests that, and
//! keeps the digest instead of the object's spec; an apply compares it with the digest of the
//! object it would send. A field someone else changed by hand has changed owner, so it falls out
//! of the projection and the digests differ: the apply puts it back, as comparing whole objects
//! did, without caching whole objects.

use std::hash::{Hash, Hasher};

use serde_json::{Map, Value};

/// The digest of the fields `manager`'s applies own in `object` (its JSON, `managedFields`
/// included); none when no apply of `manager` is recorded.
pub fn observed(object: &Value, manager: &str) -> Option<u64> {
    let entries = object.pointer("/metadata/managedFields")?.as_array()?;
    let fields = entries.iter().find(|e| e["manager"] == manager && e["operation"] == "Apply")?.get("fieldsV1")?;
    Some(digest(&normalized(project(object, fields)?)?))
}

/// The digest of an object this operator would apply, comparable with `observed`: its identity
/// (kind, version, name, namespace) is not a field anyone owns.
pub fn desired(body: &Value) -> u64 {
    let mut body = body.clone();
    if let Some(o) = body.as_object_mut() {
        o.remove("apiVersion");
        o.remove("kind");
        if let Some(meta) = o.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("name");
            meta.remove("namespace");
        }
    }
    normalized(body).as_ref().map_or(0, digest)
}

/// The parts of `value` that `fields` (a FieldsV1 tree) names. An empty tree owns the whole
/// value (a scalar, an atomic list or map, or a list item owned whole); `f:name` is a map key,
/// `k:{...}` the list item with those key fields, `v:...` a set's member, `i:N` a list index, and
/// `.` the node itself.
fn project(value: &Value, fields: &Value) -> Option<Value> {
    let fields = fields.as_object()?;
    if fields.keys().all(|k| k == ".") {
        return Some(value.clone());
    }
    match value {
        Value::Object(map) => {
            let owned: Map<String, Value> = fields
                .iter()
                .filter_map(|(k, sub)| {
                    let name = k.strip_prefix("f:")?;
                    Some((name.to_string(), project(map.get(name)?, sub)?))
                })
                .collect();
            Some(Value::Object(owned))
        }
        Value::Array(items) => {
            // Items in the order the object lists them (a list's order is part of its value).
            let owned: Vec<Value> = items
                .iter()
                .enumerate()
                .filter_map(|(i, item)| {
                    let (_, sub) = fields.iter().find(|(k, _)| names_item(k, i, item))?;
                    project(item, sub)
                })
                .collect();
            Some(Value::Array(owned))
        }
        _ => Some(value.clone()),
    }
}

/// Whether the FieldsV1 key `k` names the list item `item` at index `i`.
fn names_item(k: &str, i: usize, item: &Value) -> bool {
    if let Some(key) = k.strip_prefix("k:") {
        let Ok(Value::Object(key)) = serde_json::from_str::<Value>(key) else { return false };
        key.iter().all(|(f, v)| item.get(f) == Some(v))
    } else if let Some(member) = k.strip_prefix("v:") {
        serde_json::from_str::<Value>(member).is_ok_and(|m| &m == item)
    } else if let Some(index) = k.strip_prefix("i:") {
        index.parse() == Ok(i)
    } else {
        false
    }
}

/// Without nulls, empty maps and empty lists: "none", as the API server stores it.
fn normalized(value: Value) -> Option<Value> {
    match value {
        Value::Null => None,
        Value::Object(map) => {
            let map: Map<String, Value> = map.into_iter().filter_map(|(k, v)| Some((k, normalized(v)?))).collect();
            (!map.is_empty()).then_some(Value::Object(map))
        }
        Value::Array(items) => {
            let items: Vec<Value> = items.into_iter().filter_map(normalized).collect();
            (!items.is_empty()).then_some(Value::Array(items))
        }
        v => Some(v),
    }
}

/// A digest of a JSON value that does not depend on the order of its maps' keys.
fn digest(value: &Value) -> u64 {
    fn feed(value: &Value, h: &mut impl Hasher) {
        match value {
            Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort();
                h.write_u8(b'{');
                for k in keys {
                    k.hash(h);
                    feed(&map[k], h);
                }
                h.write_u8(b'}');
            }
            Value::Array(items) => {
                h.write_u8(b'[');
                items.iter().for_each(|v| feed(v, h));
                h.write_u8(b']');
            }
            v => v.to_string().hash(h),
        }
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    feed(value, &mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const MANAGER: &str = "kvgate-operator";

    /// What the operator applies, and the object as the API server returns it afterwards:
    /// defaults added, another manager's field, and the operator's managed fields.
    fn applied_and_stored() -> (Value, Value) {
        let applied = json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": { "name": "llm-decode", "namespace": "ns", "labels": { "app": "llm" }, "annotations": {},
                          "ownerReferences": [{ "uid": "u1", "kind": "InferenceDeployment", "name": "llm", "controller": true }] },
            "spec": { "replicas": 2, "selector": { "matchLabels": { "app": "llm" } }, "template": { "spec": {
                "containers": [{ "name": "worker", "image": "w:1", "args": ["--a", "1"], "ports": [{ "name": "http", "containerPort": 8080 }] }],
                "tolerations": [] } } }
        });
        let stored = json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": { "name": "llm-decode", "namespace": "ns", "resourceVersion": "7", "generation": 1,
                          "labels": { "app": "llm", "team": "x" },
                          "ownerReferences": [{ "uid": "u1", "kind": "InferenceDeployment", "name": "llm", "controller": true, "apiVersion": "kvgate.dev/v1alpha1" }],
                          "managedFields": [
                              { "manager": "kubectl", "operation": "Update", "fieldsV1": { "f:metadata": { "f:labels": { "f:team": {} } } } },
                              { "manager": MANAGER, "operation": "Apply", "fieldsV1": {
                                  "f:metadata": { "f:labels": { "f:app": {} }, "f:ownerReferences": { "k:{\"uid\":\"u1\"}": {} } },
                                  "f:spec": { "f:replicas": {}, "f:selector": {}, "f:template": { "f:spec": { "f:containers": { "k:{\"name\":\"worker\"}": {
                                      ".": {}, "f:name": {}, "f:image": {}, "f:args": {},
                                      "f:ports": { "k:{\"containerPort\":8080,\"protocol\":\"TCP\"}": { ".": {}, "f:name": {}, "f:containerPort": {} } } } } } } } } }
                          ] },
            "spec": { "replicas": 2, "revisionHistoryLimit": 10, "selector": { "matchLabels": { "app": "llm" } }, "template": { "spec": {
                "containers": [{ "name": "worker", "image": "w:1", "args": ["--a", "1"], "imagePullPolicy": "IfNotPresent",
                                 "ports": [{ "name": "http", "containerPort": 8080, "protocol": "TCP" }] }],
                "dnsPolicy": "ClusterFirst" } } },
            "status": { "readyReplicas": 2 }
        });
        (applied, stored)
    }

    #[test]
    fn a_stored_object_digests_as_what_was_applied_whatever_the_server_and_others_added() {
        let (applied, stored) = applied_and_stored();
        // The owner reference as applied lacks the apiVersion the server keeps: owned whole,
        // it is compared whole, so the body must carry what the server stores.
        let mut applied = applied;
        applied["metadata"]["ownerReferences"][0]["apiVersion"] = json!("kvgate.dev/v1alpha1");
        assert_eq!(observed(&stored, MANAGER), Some(desired(&applied)));
    }

    #[test]
    fn a_changed_value_a_field_taken_by_another_manager_and_a_new_field_all_differ() {
        let (mut applied, stored) = applied_and_stored();
        applied["metadata"]["ownerReferences"][0]["apiVersion"] = json!("kvgate.dev/v1alpha1");
        let want = desired(&applied);

        let mut scaled = stored.clone();
        scaled["spec"]["replicas"] = json!(3);
        assert_ne!(observed(&scaled, MANAGER), Some(want), "a value changed under the operator's ownership");

        // `kubectl scale` takes the field over: it is no longer the operator's.
        let mut taken = stored.clone();
        taken["metadata"]["managedFields"][1]["fieldsV1"]["f:spec"].as_object_mut().unwrap().remove("f:replicas");
        assert_ne!(observed(&taken, MANAGER), Some(want), "a field another manager took");

        let mut more = applied.clone();
        more["spec"]["template"]["spec"]["containers"][0]["args"] = json!(["--a", "2"]);
        assert_ne!(observed(&stored, MANAGER), Some(desired(&more)), "the operator now wants another value");

        assert_eq!(observed(&stored, "someone-else"), None, "no apply by that manager");
    }

    #[test]
    fn sets_indexes_and_key_order_are_read_as_the_server_writes_them() {
        let object = json!({ "metadata": { "finalizers": ["a", "b"], "managedFields": [{ "manager": MANAGER, "operation": "Apply", "fieldsV1": {
            "f:metadata": { "f:finalizers": { "v:\"b\"": {} } }, "f:spec": { "f:list": { "i:1": {} } } } }] },
            "spec": { "list": [1, 2, 3] } });
        assert_eq!(observed(&object, MANAGER), Some(desired(&json!({ "spec": { "list": [2] }, "metadata": { "finalizers": ["b"] } }))));
        assert_eq!(desired(&json!({ "a": 1, "b": { "c": 2, "d": 3 } })), desired(&json!({ "b": { "d": 3, "c": 2 }, "a": 1 })));
        assert_ne!(desired(&json!({ "a": [1, 2] })), desired(&json!({ "a": [2, 1] })), "a list's order is its value");
    }
}
