//! What the operator remembers of each InferenceDeployment between passes: a part of its
//! index entry (`index`), so it is keyed by UID (a namesake starts from nothing, exactly like a
//! first creation), dropped with the entry when the deployment is deleted, and never put back
//! by a pass that was still running then.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::ResourceExt;

use super::pool_condition::PoolCondition;
use crate::crd::{InferenceDeployment, InferenceDeploymentStatus};
use crate::index::Index;

/// How long a written status stands in for the watch's copy that does not show it yet.
/// resourceVersions are opaque (no order): the watch has caught up when it shows the version
/// the write returned; a relist that jumps past it is outwaited.
const WATCH_LAG: Duration = Duration::from_secs(30);

#[derive(Debug, Default)]
struct Remembered {
    /// Consecutive failed passes, for the retry backoff.
    failures: u32,
    /// `Kind/name` -> (hash of what was applied, the resourceVersion the apply returned): an
    /// object the watch still shows at that version holds what was applied.
    applied: HashMap<String, (u64, String)>,
    /// The last status written, the resourceVersion it got and when: the watch may not have
    /// delivered it yet when the next pass starts, and decisions (refuse once, promote once)
    /// must be taken on what is stored.
    status: Option<(String, Instant, InferenceDeploymentStatus)>,
    /// What the last sync of the InferencePool found (`None` inside: no pool wanted); `None`:
    /// this process has not synced it yet.
    pool: Option<Option<PoolCondition>>,
}

#[derive(Clone)]
pub struct Memory {
    index: Arc<Index>,
}

fn uid(d: &InferenceDeployment) -> String {
    d.uid().unwrap_or_default()
}

impl Memory {
    pub fn new(index: Arc<Index>) -> Memory {
        Memory { index }
    }

    /// `f` on what is remembered of `d`; `None` when `d` is gone.
    fn with<R>(&self, d: &InferenceDeployment, f: impl FnOnce(&mut Remembered) -> R) -> Option<R> {
        self.index.with(&uid(d), |e| f(e.part::<Remembered>()))
    }

    /// The deployment as the operator last wrote it, when the watch has not caught up yet.
    pub fn newest(&self, d: &InferenceDeployment) -> InferenceDeployment {
        let seen = d.resource_version();
        let written = self.with(d, |r| match &r.status {
            Some((version, at, status)) if seen.as_ref() != Some(version) && at.elapsed() < WATCH_LAG => Some(status.clone()),
            _ => {
                r.status = None;
                None
            }
        });
        match written.flatten() {
            Some(status) => InferenceDeployment { status: Some(status), ..d.clone() },
            None => d.clone(),
        }
    }

    pub fn wrote_status(&self, d: &InferenceDeployment, resource_version: Option<String>, status: &InferenceDeploymentStatus) {
        self.with(d, |r| r.status = resource_version.map(|v| (v, Instant::now(), status.clone())));
    }

    /// One more consecutive failure; how many now (0: the deployment is gone).
    pub fn failed(&self, d: &InferenceDeployment) -> u32 {
        self.with(d, |r| {
            r.failures += 1;
            r.failures
        })
        .unwrap_or(0)
    }

    pub fn succeeded(&self, d: &InferenceDeployment) {
        self.with(d, |r| r.failures = 0);
    }

    /// What the last InferencePool sync found (`None`: none by this process yet).
    pub fn pool(&self, d: &InferenceDeployment) -> Option<Option<PoolCondition>> {
        self.with(d, |r| r.pool.clone()).flatten()
    }

    /// Records what a sync found.
    pub fn pool_synced(&self, d: &InferenceDeployment, found: Option<PoolCondition>) {
        self.with(d, |r| r.pool = Some(found));
    }

    pub fn applied(&self, d: &InferenceDeployment, key: &str, hash: u64, seen_version: Option<&str>) -> bool {
        self.with(d, |r| r.applied.get(key).is_some_and(|(h, v)| *h == hash && Some(v.as_str()) == seen_version)).unwrap_or(false)
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
        let index = Arc::new(Index::default());
        for uid in ["a", "b"] {
            index.admit(uid, "ns", "llm");
        }
        let m = Memory::new(index.clone());
        let written = InferenceDeploymentStatus { phase: Some(Phase::Refused), ..Default::default() };
        m.wrote_status(&d("a", "10"), Some("x7".into()), &written);
        assert_eq!(m.newest(&d("a", "10")).status.unwrap().phase, Some(Phase::Refused), "the watch lags");
        assert_eq!(m.newest(&d("b", "10")).status, None, "same name, another UID: nothing remembered");
        assert_eq!(m.newest(&d("a", "x7")).status, None, "caught up: the stored object is the truth");
        assert_eq!(m.newest(&d("a", "10")).status, None, "and stays it: versions are compared for equality only");
        assert_eq!((m.failed(&d("a", "1")), m.failed(&d("a", "1")), m.failed(&d("b", "1"))), (1, 2, 1));

        // Deleted: nothing is remembered, and a pass still running remembers nothing again.
        assert!(index.remove("a", |_| {}));
        m.wrote_status(&d("a", "10"), Some("x8".into()), &written);
        m.set_applied(&d("a", "10"), "Deployment/x".into(), 1, Some("9".into()));
        assert_eq!((m.failed(&d("a", "1")), m.newest(&d("a", "10")).status), (0, None));
        assert!(!m.applied(&d("a", "10"), "Deployment/x", 1, Some("9")));
        assert_eq!(index.len(), 1);
    }
}
