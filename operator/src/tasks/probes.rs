//! Capacity reports, read in the background. A reconcile asks for a pod's report and gets what
//! is known now; a read is started when there is none for the pod's current container (a restart
//! starts over: the report of the process before says nothing of this one) or when a good one is
//! `REFRESH` old (serving pods are re-verified). A read that fails is tried again by its own task
//! (every `FIRST_RETRY` until the pod first answers, then every `RETRY`) for as long as
//! reconciles keep asking, and whatever changes what is known wakes the deployment's reconcile at
//! once: a pod's first report reaches the gate within one retry, not one requeue.
//!
//! What is known of each pod is a part of its deployment's index entry (`Pods`); its read is
//! the entry's `probe` task for that pod, so both go with the deployment.
//!
//! A pod this process has not read yet is `None`: not a failure, not a restart. A restarted
//! operator must not take serving pods out of traffic (or rewrite status) merely because it has
//! not asked them yet; their gate conditions carry what the operator before it verified.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::runtime::reflector::ObjectRef;
use kvgate_proto::auth::DeploymentKey;
use tokio::sync::Semaphore;

use super::Trigger;
use crate::capacity::{self, NoReport};
use crate::crd::{Engine, InferenceDeployment};
use crate::engines;
use crate::gate::Measured;
use crate::index::Index;
use crate::index::TaskKind;

/// A good report is read again this often (re-verification of serving pods).
pub const REFRESH: Duration = Duration::from_secs(20);
/// A failed read is retried this often,
pub const RETRY: Duration = Duration::from_secs(1);
/// and this often in the first `STARTING` after this process first saw the pod, until its first
/// report (a pod starting up answers any moment).
pub const FIRST_RETRY: Duration = Duration::from_millis(250);
const STARTING: Duration = Duration::from_secs(60);
/// Retries stop when no reconcile asked for the pod this long.
const WANTED: Duration = Duration::from_secs(10);
const TASK: TaskKind = TaskKind::Probe;
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

struct Pod {
    restarts: i32,
    last: Option<(Report, Instant)>,
    /// The container restarted since this process first saw the pod.
    restarted: bool,
    /// When this process first saw the pod, and whether it ever reported.
    seen: Instant,
    reported: bool,
    in_flight: bool,
    /// When a reconcile last asked.
    wanted: Instant,
}

/// What is known of a deployment's pods, by pod UID.
#[derive(Default)]
struct Pods(HashMap<String, Pod>);

pub struct Probes {
    http: reqwest::Client,
    trigger: Trigger,
    limit: Arc<Semaphore>,
    index: Arc<Index>,
}

impl Probes {
    pub fn new(http: reqwest::Client, trigger: Trigger, index: Arc<Index>) -> Arc<Self> {
        Arc::new(Probes { http, trigger, limit: Arc::new(Semaphore::new(CONCURRENT)), index })
    }

    /// What is known of `t`'s report now (`None`: this process has not read the pod yet, or the
    /// deployment is gone), and whether a read of it is due (`start`).
    pub fn known(&self, t: &Target) -> (Option<Report>, bool) {
        self.index
            .with(&t.owner_uid, |entry| {
                let mut first = false;
                let p = entry.part::<Pods>().0.entry(t.pod_uid.clone()).or_insert_with(|| {
                    first = true;
                    Pod { restarts: t.restarts, last: None, restarted: false, seen: Instant::now(), reported: false, in_flight: false, wanted: Instant::now() }
                });
                p.wanted = Instant::now();
                if p.restarts != t.restarts {
                    (p.restarts, p.last, p.restarted, p.in_flight) = (t.restarts, None, true, false);
                }
                let (known, due) = match &p.last {
                    None if p.restarted => (Some(Err(NoReport::waiting("the container restarted: reading its capacity report again"))), true),
                    None if first || p.in_flight => (None, true),
                    None => (Some(Err(NoReport::waiting("reading the pod's capacity report"))), true),
                    // A failure is retried by the read's own task; one whose task stopped (nobody
                    // asked for a while) is read again when asked.
                    Some((report, at)) => (Some(report.clone()), at.elapsed() >= if report.is_ok() { REFRESH } else { RETRY }),
                };
                (known, due && !p.in_flight)
            })
            .unwrap_or((None, false))
    }

    /// Starts reading `t` unless a read of it runs.
    pub fn start(self: &Arc<Self>, t: &Target) {
        self.index.with(&t.owner_uid, |entry| {
            let Some(p) = entry.get::<Pods>().and_then(|pods| pods.0.get_mut(&t.pod_uid)).filter(|p| !p.in_flight) else { return };
            p.in_flight = true;
            entry.spawn(TASK, &t.pod_uid, self.clone().probe(t.clone()));
        });
    }

    /// Reads `t` until it has a report, or until no reconcile asks for it any longer.
    async fn probe(self: Arc<Self>, t: Target) {
        loop {
            let report = {
                let _permit = self.limit.acquire().await.expect("never closed");
                match &t.source {
                    Source::Kvgate(key) => capacity::read(&self.http, &t.ip, t.port, &t.pod, key).await.map(Measured::Kvgate).map_err(NoReport::from),
                    Source::Engine(engine) => engines::read(&self.http, *engine, &t.ip, t.port).await.map(Measured::Engine),
                }
            };
            let outcome = self.index.with(&t.owner_uid, |entry| {
                // Forgotten meanwhile (pod deleted), or restarted: this read is moot.
                let p = entry.get::<Pods>()?.0.get_mut(&t.pod_uid).filter(|p| p.restarts == t.restarts)?;
                let changed = p.last.as_ref().is_none_or(|(before, _)| differs(before, &report));
                let again = report.is_err() && p.wanted.elapsed() < WANTED;
                p.reported |= report.is_ok();
                let wait = if p.reported || p.seen.elapsed() >= STARTING { RETRY } else { FIRST_RETRY };
                (p.last, p.restarted, p.in_flight) = (Some((report, Instant::now())), false, again);
                Some((changed, again.then_some(wait)))
            });
            let Some(Some((changed, again))) = outcome else { return };
            if changed {
                self.trigger.reconcile(&t.owner);
            }
            match again {
                Some(wait) => tokio::time::sleep(wait).await,
                None => return,
            }
        }
    }

    /// Drops what is known of a pod (deleted), and stops reading it.
    pub fn forget_pod(&self, pod_uid: &str) {
        self.index.each(|entry| {
            if entry.get::<Pods>().and_then(|pods| pods.0.remove(pod_uid)).is_some() {
                entry.stop(TASK, pod_uid);
            }
        });
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
        let forged: Report = Err(NoReport { reason: crate::capacity::NoReportReason::Unauthenticated, message: "x".into() });
        assert!(differs(&refused("connection refused"), &forged));
    }

    fn target(port: u16) -> Target {
        Target {
            pod_uid: "p".into(),
            pod: "pod".into(),
            ip: "127.0.0.1".into(),
            port,
            restarts: 0,
            owner: ObjectRef::new("d").within("ns"),
            owner_uid: "u".into(),
            source: Source::Kvgate(crate::keys::RootKey::from_bytes([1; 32]).deployment_key("u")),
        }
    }

    fn probes() -> (Arc<Probes>, Arc<Index>) {
        let (trigger, _rx) = Trigger::new();
        let index = Arc::new(Index::default());
        index.admit("u", "ns", "d");
        (Probes::new(crate::capacity::client(), trigger, index.clone()), index)
    }

    /// What a pass sees, and the read it starts when one is due.
    fn read(probes: &Arc<Probes>, t: &Target) -> Option<Report> {
        let (known, due) = probes.known(t);
        if due {
            probes.start(t);
        }
        known
    }

    fn last(index: &Index) -> Option<Report> {
        index.with("u", |e| e.get::<Pods>()?.0.get("p")?.last.as_ref().map(|(r, _)| r.clone())).flatten()
    }

    #[tokio::test]
    async fn a_restart_forgets_the_report_of_the_process_before() {
        let (probes, index) = probes();
        // Nothing listens here: every read fails fast.
        let mut t = target(9);
        assert_eq!(read(&probes, &t), None, "not read yet: unknown, not failed");
        for _ in 0..250 {
            if last(&index).is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let failed = read(&probes, &t).unwrap().unwrap_err();
        assert!(failed.message.contains("127.0.0.1:9"), "the read's own failure: {failed:?}");
        assert_eq!(index.running_tasks().get(&TASK), Some(&1), "a failed read is retried by its own task");
        t.restarts = 1;
        assert!(read(&probes, &t).unwrap().unwrap_err().message.contains("restarted"));
        probes.forget_pod("p");
        assert!(last(&index).is_none() && index.running_tasks().is_empty(), "a deleted pod is neither known nor read");
    }

    #[tokio::test]
    async fn a_deployment_deleted_mid_read_stops_the_read_and_nothing_comes_back() {
        use tokio::io::AsyncReadExt;
        // A pod that accepts the read and never answers it.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (probes, index) = probes();
        let t = target(silent.local_addr().unwrap().port());
        assert_eq!(read(&probes, &t), None);
        let (mut conn, _) = silent.accept().await.unwrap();
        assert!(index.remove("u", |_| {}), "deleted while its read is in flight");
        let mut buf = [0u8; 4096];
        let closed = tokio::time::timeout(Duration::from_secs(5), async { while conn.read(&mut buf).await.is_ok_and(|n| n > 0) {} });
        assert!(closed.await.is_ok(), "the read was not aborted with its deployment");
        // A pass that was still running asks again: nothing is started or remembered.
        assert_eq!(read(&probes, &t), None);
        assert!(index.is_empty() && index.running_tasks().is_empty());
    }
}
