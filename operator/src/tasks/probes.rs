//! Capacity reports, read in the background. A reconcile asks for a pod's report and gets what
//! is known now; a read is started when there is none for the pod's current container (a restart
//! starts over: the report of the process before says nothing of this one), when a failed read is
//! a second old, or when a good one is `REFRESH` old (serving pods are re-verified). A finished
//! read that changes what is known wakes the deployment's reconcile.
//!
//! A pod this process has not read yet is `None`: not a failure, not a restart. A restarted
//! operator must not take serving pods out of traffic (or rewrite status) merely because it has
//! not asked them yet; their gate conditions carry what the operator before it verified.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::runtime::reflector::ObjectRef;
use kvgate_proto::auth::DeploymentKey;
use tokio::sync::Semaphore;

use super::Trigger;
use crate::capacity::{self, NoReport};
use crate::crd::{Engine, InferenceDeployment};
use crate::engines;
use crate::gate::Measured;

/// A good report is read again this often (re-verification of serving pods).
pub const REFRESH: Duration = Duration::from_secs(20);
/// A failed read is retried this often.
pub const RETRY: Duration = Duration::from_secs(1);
/// Reads in flight at once, over every deployment.
const CONCURRENT: usize = 32;

pub type Report = Result<Measured, NoReport>;

/// Where a pod's capacity comes from.
#[derive(Clone, Debug)]
pub enum Source {
    /// A kvgate worker's report, verified with the deployment's key.
    Kvgate(DeploymentKey),
    /// What an external engine says (unsigned).
    Engine(Engine),
}

/// One pod to read.
#[derive(Clone, Debug)]
pub struct Target {
    pub pod_uid: String,
    pub pod: String,
    pub ip: String,
    pub port: u16,
    /// The container's restart count: a new process, a new report.
    pub restarts: i32,
    pub owner: ObjectRef<InferenceDeployment>,
    pub owner_uid: String,
    pub source: Source,
}

struct Entry {
    owner_uid: String,
    restarts: i32,
    last: Option<(Report, Instant)>,
    /// The container restarted since this process first saw the pod.
    restarted: bool,
    in_flight: bool,
}

pub struct Probes {
    http: reqwest::Client,
    trigger: Trigger,
    limit: Arc<Semaphore>,
    entries: Mutex<HashMap<String, Entry>>,
}

impl Probes {
    pub fn new(http: reqwest::Client, trigger: Trigger) -> Arc<Self> {
        Arc::new(Probes { http, trigger, limit: Arc::new(Semaphore::new(CONCURRENT)), entries: Mutex::default() })
    }

    /// What is known of `t`'s report now (`None`: this process has not read the pod yet);
    /// starts a read when one is due.
    pub fn read(self: &Arc<Self>, t: &Target) -> Option<Report> {
        let mut entries = self.entries.lock().unwrap();
        let mut first = false;
        let e = entries.entry(t.pod_uid.clone()).or_insert_with(|| {
            first = true;
            Entry { owner_uid: t.owner_uid.clone(), restarts: t.restarts, last: None, restarted: false, in_flight: false }
        });
        if e.restarts != t.restarts {
            e.restarts = t.restarts;
            e.last = None;
            e.restarted = true;
        }
        let (known, due) = match &e.last {
            None if e.restarted => (Some(Err(NoReport::waiting("the container restarted: reading its capacity report again"))), true),
            None if first || e.in_flight => (None, true),
            None => (Some(Err(NoReport::waiting("reading the pod's capacity report"))), true),
            Some((report, at)) => (Some(report.clone()), at.elapsed() >= if report.is_ok() { REFRESH } else { RETRY }),
        };
        if due && !e.in_flight {
            e.in_flight = true;
            tokio::spawn(self.clone().probe(t.clone()));
        }
        known
    }

    async fn probe(self: Arc<Self>, t: Target) {
        let report = {
            let _permit = self.limit.acquire().await.expect("never closed");
            match &t.source {
                Source::Kvgate(key) => capacity::read(&self.http, &t.ip, t.port, &t.pod, key).await.map(Measured::Kvgate).map_err(NoReport::from),
                Source::Engine(engine) => engines::read(&self.http, *engine, &t.ip, t.port).await.map(Measured::Engine),
            }
        };
        let changed = {
            let mut entries = self.entries.lock().unwrap();
            // Forgotten meanwhile (pod or deployment deleted), or restarted: this read is moot.
            let Some(e) = entries.get_mut(&t.pod_uid) else { return };
            e.in_flight = false;
            if e.restarts != t.restarts {
                return;
            }
            let changed = e.last.as_ref().is_none_or(|(before, _)| differs(before, &report));
            e.last = Some((report, Instant::now()));
            e.restarted = false;
            changed
        };
        if changed {
            self.trigger.reconcile(&t.owner);
        }
    }

    /// Drops what is known of a pod (deleted).
    pub fn forget_pod(&self, pod_uid: &str) {
        self.entries.lock().unwrap().remove(pod_uid);
    }

    /// Drops what is known of every pod of a deployment (deleted).
    pub fn forget_owner(&self, owner_uid: &str) {
        self.entries.lock().unwrap().retain(|_, e| e.owner_uid != owner_uid);
    }

    /// Pods with something known (for tests and the lifecycle's checks).
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Whether a new read tells the gate something else: another report, or another kind of
/// failure. A failure whose text alone changed (another connection error) is picked up by the
/// next pass without waking one.
fn differs(before: &Report, now: &Report) -> bool {
    match (before, now) {
        (Ok(a), Ok(b)) => a != b,
        (Err(a), Err(b)) => a.reason != b.reason,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_new_report_or_a_new_kind_of_failure_is_news() {
        let refused = |m: &str| Err(NoReport::waiting(m));
        assert!(!differs(&refused("connection refused"), &refused("timed out")));
        let forged: Report = Err(NoReport { reason: "UnauthenticatedReport", message: "x".into() });
        assert!(differs(&refused("connection refused"), &forged));
    }

    #[tokio::test]
    async fn a_restart_forgets_the_report_of_the_process_before() {
        let (trigger, _rx) = Trigger::new();
        let probes = Probes::new(crate::capacity::client(), trigger);
        let mut t = Target {
            pod_uid: "p".into(),
            pod: "pod".into(),
            // Nothing listens here: every read fails fast.
            ip: "127.0.0.1".into(),
            port: 9,
            restarts: 0,
            owner: ObjectRef::new("d").within("ns"),
            owner_uid: "u".into(),
            source: Source::Kvgate(crate::keys::RootKey::from_bytes([1; 32]).deployment_key("u")),
        };
        assert_eq!(probes.read(&t), None, "not read yet: unknown, not failed");
        for _ in 0..250 {
            if !probes.entries.lock().unwrap()["p"].in_flight {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let failed = probes.read(&t).unwrap().unwrap_err();
        assert!(failed.message.contains("127.0.0.1:9"), "the read's own failure: {failed:?}");
        t.restarts = 1;
        assert!(probes.read(&t).unwrap().unwrap_err().message.contains("restarted"));
        probes.forget_owner("u");
        assert!(probes.is_empty());
    }
}
