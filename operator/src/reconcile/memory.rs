//! What the operator remembers of each InferenceDeployment between passes, keyed by UID, so a
//! deployment deleted and re-created under the same name starts from nothing, exactly like a
//! first creation; and everything is dropped when the deployment is deleted (`lifecycle`).

use std::collections::HashMap;
use std::sync::Mutex;

use kube::ResourceExt;

use crate::crd::{InferenceDeployment, InferenceDeploymentStatus};

#[derive(Debug, Default)]
struct Remembered {
    namespace: String,
    name: String,
    /// Consecutive failed passes, for the retry backoff.
    failures: u32,
    /// `Kind/name` -> (hash of what was applied, the resourceVersion the apply returned): an
    /// object the watch still shows at that version holds what was applied.
    applied: HashMap<String, (u64, String)>,
    /// The last status written and the resourceVersion it got: the watch may not have
    /// delivered it yet when the next pass starts, and decisions (refuse once, promote once)
    /// must be taken on what is stored.
    status: Option<(u64, InferenceDeploymentStatus)>,
}

#[derive(Debug, Default)]
pub struct Memory {
    by_uid: Mutex<HashMap<String, Remembered>>,
}

fn uid(d: &InferenceDeployment) -> String {
    d.uid().unwrap_or_default()
}

impl Memory {
    fn with<R>(&self, d: &InferenceDeployment, f: impl FnOnce(&mut Remembered) -> R) -> R {
        let mut map = self.by_uid.lock().unwrap();
        let r = map.entry(uid(d)).or_insert_with(|| Remembered { namespace: d.namespace().unwrap_or_default(), name: d.name_any(), ..Default::default() });
        f(r)
    }

    /// The deployment as the operator last wrote it, when the watch has not caught up yet.
    pub fn newest(&self, d: &InferenceDeployment) -> InferenceDeployment {
        let seen = d.resource_version().and_then(|v| v.parse::<u64>().ok());
        let written = self.by_uid.lock().unwrap().get(&uid(d)).and_then(|r| r.status.clone());
        match (seen, written) {
            (Some(seen), Some((version, status))) if seen < version => InferenceDeployment { status: Some(status), ..d.clone() },
            _ => d.clone(),
        }
    }

    pub fn wrote_status(&self, d: &InferenceDeployment, resource_version: Option<&str>, status: &InferenceDeploymentStatus) {
        let version = resource_version.and_then(|v| v.parse::<u64>().ok());
        self.with(d, |r| r.status = version.map(|v| (v, status.clone())));
    }

    /// One more consecutive failure; how many now.
    pub fn failed(&self, d: &InferenceDeployment) -> u32 {
        self.with(d, |r| {
            r.failures += 1;
            r.failures
        })
    }

    pub fn succeeded(&self, d: &InferenceDeployment) {
        self.with(d, |r| r.failures = 0);
    }

    pub fn applied(&self, d: &InferenceDeployment, key: &str, hash: u64, seen_version: Option<&str>) -> bool {
        self.with(d, |r| r.applied.get(key).is_some_and(|(h, v)| *h == hash && Some(v.as_str()) == seen_version))
    }

    pub fn set_applied(&self, d: &InferenceDeployment, key: String, hash: u64, version: Option<String>) {
        self.with(d, |r| match version {
            Some(v) => {
                r.applied.insert(key, (hash, v));
            }
            None => {
                r.applied.remove(&key);
            }
        });
    }

    /// Forgets a UID; its namespace and name, if it was known.
    pub fn forget(&self, uid: &str) -> Option<(String, String)> {
        self.by_uid.lock().unwrap().remove(uid).map(|r| (r.namespace, r.name))
    }

    /// Every UID remembered, with its namespace and name.
    pub fn known(&self) -> Vec<(String, String, String)> {
        self.by_uid.lock().unwrap().iter().map(|(uid, r)| (uid.clone(), r.namespace.clone(), r.name.clone())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout_state::Phase;

    fn d(uid: &str, version: &str) -> InferenceDeployment {
        let spec = serde_json::json!({ "model": { "name": "tiny" }, "contextWindow": 8, "prefill": { "kvPool": {} }, "decode": { "kvPool": {} } });
        let mut d = InferenceDeployment::for_test(spec);
        d.metadata.uid = Some(uid.into());
        d.metadata.resource_version = Some(version.into());
        d
    }

    #[test]
    fn a_status_the_watch_has_not_delivered_is_used_until_it_has_and_a_new_uid_starts_clean() {
        let m = Memory::default();
        let written = InferenceDeploymentStatus { phase: Some(Phase::Refused), ..Default::default() };
        m.wrote_status(&d("a", "10"), Some("12"), &written);
        assert_eq!(m.newest(&d("a", "10")).status.unwrap().phase, Some(Phase::Refused), "the watch lags");
        assert_eq!(m.newest(&d("a", "12")).status, None, "caught up: the stored object is the truth");
        assert_eq!(m.newest(&d("a", "15")).status, None, "changed since: the stored object is newer");
        assert_eq!(m.newest(&d("b", "10")).status, None, "same name, another UID: nothing remembered");
        assert_eq!((m.failed(&d("a", "1")), m.failed(&d("a", "1")), m.failed(&d("b", "1"))), (1, 2, 1));
        assert_eq!(m.forget("a"), Some(("ns".to_string(), "llm".to_string())));
        assert_eq!(m.failed(&d("a", "1")), 1);
    }
}
