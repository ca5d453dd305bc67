//! Leader election with a coordination.k8s.io Lease, so that of several operator replicas only
//! one reconciles. Updates carry the Lease's resourceVersion: two replicas racing for it cannot
//! both win. The holder renews from the Lease its last update returned (one PUT every 5 s, no
//! GET); it reads the Lease again only when an update conflicts.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};

pub struct Elector {
    api: Api<Lease>,
    /// The Lease as this replica's last successful update left it.
    held: std::sync::Mutex<Option<Lease>>,
    name: String,
    identity: String,
    /// A holder that has not renewed for this long has lost the Lease.
    duration: Duration,
}

impl Elector {
    pub fn new(client: kube::Client, namespace: &str, name: &str, identity: &str) -> Self {
        Elector {
            api: Api::namespaced(client, namespace),
            held: std::sync::Mutex::new(None),
            name: name.into(),
            identity: identity.into(),
            duration: Duration::from_secs(15),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Blocks until this replica holds the Lease.
    pub async fn acquire(&self) {
        loop {
            match self.try_acquire().await {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "leader election: cannot read the Lease"),
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }

    /// Renews every few seconds; returns when the Lease could not be renewed before it expired.
    pub async fn keep(&self) -> anyhow::Error {
        let mut last = std::time::Instant::now();
        loop {
            tokio::time::sleep(self.duration / 3).await;
            match self.try_acquire().await {
                Ok(true) => last = std::time::Instant::now(),
                Ok(false) => return anyhow::anyhow!("leader election: another replica took the Lease {}", self.name),
                Err(e) => tracing::warn!(error = %e, "leader election: renewing failed"),
            }
            if last.elapsed() > self.duration {
                return anyhow::anyhow!("leader election: could not renew the Lease {} for {:?}", self.name, self.duration);
            }
        }
    }

    /// Gives the Lease up at shutdown so a standby takes over at once.
    pub async fn release(&self) {
        self.held.lock().unwrap().take();
        if let Ok(Some(mut lease)) = self.api.get_opt(&self.name).await
            && let Some(spec) = lease.spec.as_mut().filter(|s| s.holder_identity.as_deref() == Some(&self.identity))
        {
            spec.holder_identity = None;
            spec.renew_time = None;
            let _ = self.api.replace(&self.name, &PostParams::default(), &lease).await;
        }
    }

    /// Takes or renews the Lease if it is free, expired or ours.
    async fn try_acquire(&self) -> anyhow::Result<bool> {
        let held = self.held.lock().unwrap().take();
        if let Some(mut lease) = held {
            // Renewing: the Lease as our last update left it, unless someone changed it since.
            let spec = lease.spec.get_or_insert_with(Default::default);
            spec.renew_time = Some(MicroTime(Timestamp::now()));
            match self.api.replace(&self.name, &PostParams::default(), &lease).await {
                Ok(renewed) => {
                    *self.held.lock().unwrap() = Some(renewed);
                    return Ok(true);
                }
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(e.into()),
            }
        }
        let now = Timestamp::now();
        let secs = self.duration.as_secs() as i32;
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(self.name.clone()), ..Default::default() },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(secs),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return Ok(match self.api.create(&PostParams::default(), &lease).await {
                Ok(created) => {
                    *self.held.lock().unwrap() = Some(created);
                    true
                }
                Err(_) => false,
            });
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        let ours = spec.holder_identity.as_deref() == Some(&self.identity);
        let expired = match (&spec.holder_identity, &spec.renew_time) {
            (None, _) | (_, None) => true,
            (Some(_), Some(MicroTime(t))) => now.duration_since(*t).as_secs() > spec.lease_duration_seconds.unwrap_or(secs) as i64,
        };
        if !ours && !expired {
            return Ok(false);
        }
        if !ours {
            spec.acquire_time = Some(MicroTime(now));
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            spec.holder_identity = Some(self.identity.clone());
        }
        spec.renew_time = Some(MicroTime(now));
        spec.lease_duration_seconds = Some(secs);
        // replace() sends the resourceVersion we read: a concurrent writer makes this fail.
        Ok(match self.api.replace(&self.name, &PostParams::default(), &lease).await {
            Ok(ours) => {
                *self.held.lock().unwrap() = Some(ours);
                true
            }
            Err(_) => false,
        })
    }
}
