//! Writes only differences, for an object read whole (the InferencePool, read when its pass
//! needs it; watched kinds compare digests, `cached`): an object the operator would apply is
//! compared with the one read. Everything the operator sets must be there with the same value;
//! what the API server adds (defaults, status, its own metadata) is not a difference.

use serde_json::Value;

/// Whether `observed` already holds every field `desired` sets, with the same value.
pub fn holds(observed: &Value, desired: &Value) -> bool {
    match (observed, desired) {
        (_, Value::Null) => true,
        // Empty lists and maps mean "none", and the API server drops them.
        (Value::Null, Value::Array(d)) => d.is_empty(),
        (Value::Null, Value::Object(d)) => d.values().all(|v| holds(&Value::Null, v)),
        (Value::Object(o), Value::Object(d)) => d.iter().all(|(k, v)| holds(o.get(k).unwrap_or(&Value::Null), v)),
        (Value::Array(o), Value::Array(d)) => o.len() == d.len() && o.iter().zip(d).all(|(o, d)| holds(o, d)),
        (o, d) => o == d,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn defaults_added_by_the_server_are_no_difference_but_a_changed_value_is() {
        let desired = json!({ "spec": { "replicas": 2, "ports": [{ "name": "http", "port": 80 }], "tolerations": [], "selector": { "a": "b" } } });
        let observed = json!({
            "metadata": { "resourceVersion": "7" },
            "spec": { "replicas": 2, "ports": [{ "name": "http", "port": 80, "protocol": "TCP" }], "selector": { "a": "b" }, "revisionHistoryLimit": 10 },
            "status": { "readyReplicas": 2 },
        });
        assert!(holds(&observed, &desired));
        let mut scaled = desired.clone();
        scaled["spec"]["replicas"] = json!(3);
        assert!(!holds(&observed, &scaled));
        let mut more_ports = desired.clone();
        more_ports["spec"]["ports"].as_array_mut().unwrap().push(json!({ "name": "kv", "port": 8083 }));
        assert!(!holds(&observed, &more_ports), "an element added");
        assert!(!holds(&json!({ "spec": {} }), &desired), "a field missing");
        assert!(holds(&json!({}), &json!({ "metadata": { "annotations": {} } })), "an empty map is no map");
    }
}
