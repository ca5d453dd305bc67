//! Reading the API server's audit log (`Options::audit`): who sent which requests, and when.

use std::collections::HashSet;
use std::path::Path;

use k8s_openapi::jiff::Timestamp;

/// One request as the audit log records it.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub user_agent: String,
    pub user: String,
    /// get, list, watch, create, patch, update, delete, ...
    pub verb: String,
    pub resource: String,
    pub received: Timestamp,
}

impl Request {
    /// A request that changes something.
    pub fn writes(&self) -> bool {
        matches!(self.verb.as_str(), "create" | "update" | "patch" | "delete" | "deletecollection")
    }
}

/// Every request received in `[from, to)`, once each (a watch is logged when its response
/// starts and again when it ends).
pub fn requests(log: &Path, from: Timestamp, to: Timestamp) -> Vec<Request> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut seen = HashSet::new();
    text.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|e| seen.insert(e["auditID"].as_str().unwrap_or_default().to_string()))
        .filter_map(|e| {
            let received: Timestamp = e["requestReceivedTimestamp"].as_str()?.parse().ok()?;
            (received >= from && received < to).then(|| Request {
                user_agent: e["userAgent"].as_str().unwrap_or_default().to_string(),
                user: e["user"]["username"].as_str().unwrap_or_default().to_string(),
                verb: e["verb"].as_str().unwrap_or_default().to_string(),
                resource: e["objectRef"]["resource"].as_str().unwrap_or_default().to_string(),
                received,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_request_counts_once_within_its_window() {
        let dir = std::env::temp_dir().join(format!("kvgate-audit-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("audit.log");
        let event = |id: &str, stage: &str, at: &str, verb: &str| {
            format!(
                r#"{{"auditID":"{id}","stage":"{stage}","verb":"{verb}","userAgent":"kvgate-operator/0.1.0","user":{{"username":"admin"}},"objectRef":{{"resource":"pods"}},"requestReceivedTimestamp":"{at}"}}"#
            )
        };
        let lines = [
            event("a", "ResponseStarted", "2026-12-01T10:00:01.000000Z", "watch"),
            event("a", "ResponseComplete", "2026-12-01T10:00:01.000000Z", "watch"),
            event("b", "ResponseComplete", "2026-12-01T10:00:02.500000Z", "patch"),
            event("c", "ResponseComplete", "2026-12-01T10:00:09.000000Z", "get"),
        ];
        std::fs::write(&log, lines.join("\n")).unwrap();
        let got = requests(&log, "2026-12-01T10:00:00Z".parse().unwrap(), "2026-12-01T10:00:05Z".parse().unwrap());
        assert_eq!(got.iter().map(|r| (r.verb.as_str(), r.writes())).collect::<Vec<_>>(), [("watch", false), ("patch", true)]);
        assert_eq!(got[0].user_agent, "kvgate-operator/0.1.0");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
