//! The operator's metrics, and the HTTP server for /metrics, /healthz and /readyz.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::canary::Probe;
use crate::crd::Engine;
use crate::index::{Index, TaskKind};
use crate::rollout_state::{Phase, RefusalReason, RollbackReason};
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use prometheus::{Encoder, Histogram, HistogramOpts, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    pub reconciles: IntCounterVec,
    pub reconcile_duration: Histogram,
    pub refused: IntCounterVec,
    pub pool_tokens: IntGaugeVec,
    pub context_window: IntGaugeVec,
    pub refused_now: IntGaugeVec,
    pub leader: IntGauge,
    pub synced: IntGauge,
    pub canaries: IntCounterVec,
    pub canary_duration: Histogram,
    pub unverified_serving: IntGaugeVec,
    pub phase: IntGaugeVec,
    pub rollbacks: IntCounterVec,
    pub probe_mismatches: IntCounterVec,
}

/// The roles a probe's question goes to: a kvgate pair, an engine's server, a router.
pub const PROBE_ROLES: [&str; 3] = ["pair", "server", "router"];

/// Every label value a counter can take, so rates work from the first scrape. Phases and
/// reasons come from their enums (`rollout_state`): a new variant cannot be missed.
pub const RESULTS: [&str; 2] = ["success", "error"];
pub const CANARY_RESULTS: [&str; 2] = ["passed", "failed"];

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let reconciles = IntCounterVec::new(Opts::new("kvgate_operator_reconcile_total", "Reconciles of InferenceDeployments by result"), &["result"]).unwrap();
        let reconcile_duration = Histogram::with_opts(
            HistogramOpts::new("kvgate_operator_reconcile_duration_seconds", "Time one reconcile takes")
                .buckets(vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
        )
        .unwrap();
        let refused =
            IntCounterVec::new(Opts::new("kvgate_operator_rollouts_refused_total", "Revisions refused by the rollout gate, by reason"), &["reason"]).unwrap();
        let pool_tokens = IntGaugeVec::new(
            Opts::new(
                "kvgate_operator_kv_pool_capacity_tokens",
                "Smallest measured KV pool of the serving revision's pods (tokens); absent before a revision serves",
            ),
            &["namespace", "name", "role"],
        )
        .unwrap();
        let context_window = IntGaugeVec::new(
            Opts::new("kvgate_operator_context_window_tokens", "Declared context window of each InferenceDeployment (tokens)"),
            &["namespace", "name"],
        )
        .unwrap();
        let refused_now = IntGaugeVec::new(
            Opts::new("kvgate_operator_rollout_refused", "1 while the revision an InferenceDeployment's spec asks for stands refused by the rollout gate"),
            &["namespace", "name", "reason"],
        )
        .unwrap();
        let canaries =
            IntCounterVec::new(Opts::new("kvgate_operator_canary_runs_total", "Integrity canaries run on candidate revisions, by result"), &["result"])
                .unwrap();
        let canary_duration = Histogram::with_opts(
            HistogramOpts::new("kvgate_operator_canary_duration_seconds", "Time one integrity canary takes (every prompt through every pair)")
                .buckets(vec![0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]),
        )
        .unwrap();
        let unverified_serving = IntGaugeVec::new(
            Opts::new(
                "kvgate_operator_serving_pods_unverified",
                "Pods of the serving revision that no longer pass the rollout gate (out of the EndpointSlices)",
            ),
            &["namespace", "name"],
        )
        .unwrap();
        let phase =
            IntGaugeVec::new(Opts::new("kvgate_operator_rollout_phase", "1 for each InferenceDeployment's current phase"), &["namespace", "name", "phase"])
                .unwrap();
        let rollbacks =
            IntCounterVec::new(Opts::new("kvgate_operator_rollbacks_total", "Promoted revisions rolled back during their bake, by reason"), &["reason"])
                .unwrap();
        let probe_mismatches = IntCounterVec::new(
            Opts::new(
                "kvgate_operator_probe_mismatches_total",
                "Pairs or pods a probe caught answering what they must not: past the window (boundary) or other tokens after other prompts filled the pool (stale_kv)",
            ),
            &["engine", "role", "probe"],
        )
        .unwrap();
        let leader = IntGauge::new("kvgate_operator_leader", "1 while this replica holds the leader Lease (and reconciles)").unwrap();
        let synced = IntGauge::new(
            "kvgate_operator_watches_synced",
            "1 once every watch of this replica has listed its kind (the leader, or a warm standby ready to take over)",
        )
        .unwrap();
        let build = IntGaugeVec::new(Opts::new("kvgate_build_info", "Build information; always 1"), &["component", "version"]).unwrap();
        build.with_label_values(&["operator", env!("CARGO_PKG_VERSION")]).set(1);
        for c in [
            Box::new(reconciles.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(reconcile_duration.clone()),
            Box::new(refused.clone()),
            Box::new(pool_tokens.clone()),
            Box::new(context_window.clone()),
            Box::new(refused_now.clone()),
            Box::new(leader.clone()),
            Box::new(synced.clone()),
            Box::new(canaries.clone()),
            Box::new(canary_duration.clone()),
            Box::new(unverified_serving.clone()),
            Box::new(phase.clone()),
            Box::new(rollbacks.clone()),
            Box::new(probe_mismatches.clone()),
            Box::new(build),
        ] {
            registry.register(c).unwrap();
        }
        for r in RESULTS {
            reconciles.with_label_values(&[r]);
        }
        for r in RefusalReason::ALL {
            refused.with_label_values(&[r.as_str()]);
        }
        for r in CANARY_RESULTS {
            canaries.with_label_values(&[r]);
        }
        for r in RollbackReason::ALL {
            rollbacks.with_label_values(&[r.as_str()]);
        }
        for engine in <Engine as strum::VariantArray>::VARIANTS {
            for role in PROBE_ROLES {
                for probe in <Probe as strum::VariantArray>::VARIANTS {
                    probe_mismatches.with_label_values(&[engine.as_str(), role, probe.into()]);
                }
            }
        }
        Metrics {
            registry,
            reconciles,
            reconcile_duration,
            refused,
            pool_tokens,
            context_window,
            refused_now,
            leader,
            synced,
            canaries,
            canary_duration,
            unverified_serving,
            phase,
            rollbacks,
            probe_mismatches,
        }
    }

    /// The per-deployment gauges, from its status: the window, the serving revision's smallest
    /// measured pools, whether the spec's revision stands refused, the phase, and how many
    /// serving pods failed re-verification.
    pub fn export(&self, ns: &str, name: &str, context_window: u64, status: &crate::crd::InferenceDeploymentStatus, unverified: usize) {
        self.context_window.with_label_values(&[ns, name]).set(context_window as i64);
        self.unverified_serving.with_label_values(&[ns, name]).set(unverified as i64);
        for p in Phase::ALL {
            self.phase.with_label_values(&[ns, name, p.as_str()]).set(i64::from(status.phase == Some(*p)));
        }
        for (role, rs) in [("prefill", &status.prefill), ("decode", &status.decode), ("server", &status.server)] {
            let serving = rs.as_ref().filter(|r| r.revision.is_some() && r.revision == status.current_revision);
            match serving.and_then(|r| r.min_measured_tokens) {
                Some(tokens) => self.pool_tokens.with_label_values(&[ns, name, role]).set(tokens as i64),
                None => {
                    let _ = self.pool_tokens.remove_label_values(&[ns, name, role]);
                }
            }
        }
        let refused = status.refused_revision.as_ref().filter(|_| crate::conditions::is_true(&status.conditions, crate::conditions::ROLLOUT_REFUSED));
        for reason in RefusalReason::ALL {
            let _ = self.refused_now.remove_label_values(&[ns, name, reason.as_str()]);
        }
        if let Some(r) = refused {
            self.refused_now.with_label_values(&[ns, name, r.reason.as_str()]).set(1);
        }
    }

    /// Exports the index's size and its running tasks (every `TaskKind`, 0 when none
    /// runs), read at each scrape.
    pub fn watch_index(&self, index: Arc<Index>) {
        let deployments = IntGauge::new("kvgate_operator_indexed_deployments", "InferenceDeployments the operator holds state for").unwrap();
        let tasks =
            IntGaugeVec::new(Opts::new("kvgate_operator_background_tasks", "Background tasks running for InferenceDeployments, by kind"), &["kind"]).unwrap();
        self.registry.register(Box::new(IndexGauges { index, deployments, tasks })).unwrap();
    }

    /// Removes every series of one InferenceDeployment (deleted): no alert fires for an
    /// object that no longer exists.
    pub fn forget(&self, ns: &str, name: &str) {
        let _ = self.context_window.remove_label_values(&[ns, name]);
        let _ = self.unverified_serving.remove_label_values(&[ns, name]);
        for p in Phase::ALL {
            let _ = self.phase.remove_label_values(&[ns, name, p.as_str()]);
        }
        for role in ["prefill", "decode", "server"] {
            let _ = self.pool_tokens.remove_label_values(&[ns, name, role]);
        }
        for reason in RefusalReason::ALL {
            let _ = self.refused_now.remove_label_values(&[ns, name, reason.as_str()]);
        }
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf).unwrap();
        String::from_utf8(buf).unwrap()
    }
}

/// The index's gauges, set from the index when scraped.
struct IndexGauges {
    index: Arc<Index>,
    deployments: IntGauge,
    tasks: IntGaugeVec,
}

impl prometheus::core::Collector for IndexGauges {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.deployments.desc().into_iter().chain(self.tasks.desc()).collect()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        self.deployments.set(self.index.len() as i64);
        self.tasks.reset();
        for kind in <TaskKind as strum::VariantArray>::VARIANTS {
            self.tasks.with_label_values(&[kind.as_str()]).set(0);
        }
        for (kind, n) in self.index.running_tasks() {
            self.tasks.with_label_values(&[kind.as_str()]).set(n as i64);
        }
        self.deployments.collect().into_iter().chain(self.tasks.collect()).collect()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Liveness and readiness: live while the process serves; ready once it has reached the API
/// server and found the CRD (a standby replica waiting for the Lease is ready too, so rolling
/// updates of the operator proceed; `kvgate_operator_leader` says which one leads).
#[derive(Clone, Default)]
pub struct Health {
    pub ready: Arc<AtomicBool>,
}

pub async fn serve(addr: SocketAddr, metrics: Metrics, health: Health, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
    let app = Router::new()
        .route("/metrics", get(|State((m, _)): State<(Metrics, Health)>| async move { m.render() }))
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State((_, h)): State<(Metrics, Health)>| async move {
                if h.ready.load(Ordering::SeqCst) { (StatusCode::OK, "ready") } else { (StatusCode::SERVICE_UNAVAILABLE, "not started") }
            }),
        )
        .with_state((metrics, health));
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("binding {addr}: {e}"))?;
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{InferenceDeploymentStatus, RefusedRevision};
    use crate::rollout_state::{Phase, RefusalReason};

    #[test]
    fn a_forgotten_deployment_has_no_series_left_and_its_namesakes_neighbours_keep_theirs() {
        let m = Metrics::new();
        let refused = InferenceDeploymentStatus {
            phase: Some(Phase::Refused),
            refused_revision: Some(RefusedRevision { revision: "r".into(), reason: RefusalReason::CanaryFailed, message: "m".into(), rolled_back: false }),
            ..Default::default()
        };
        let mut refused = refused;
        crate::conditions::set(
            &mut refused.conditions,
            crate::conditions::ROLLOUT_REFUSED,
            true,
            crate::reasons::Reason::Refused(crate::rollout_state::RefusalReason::CanaryFailed),
            "m".into(),
            None,
            &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
        );
        m.export("ns", "bad", 1024, &refused, 0);
        m.export("ns", "good", 1024, &InferenceDeploymentStatus { phase: Some(Phase::Available), ..Default::default() }, 0);
        let text = m.render();
        assert!(text.contains(r#"kvgate_operator_rollout_refused{name="bad",namespace="ns",reason="CanaryFailed"} 1"#), "{text}");
        m.forget("ns", "bad");
        let text = m.render();
        assert!(!text.lines().any(|l| l.contains(r#"name="bad""#)), "{text}");
        assert!(text.contains(r#"kvgate_operator_rollout_phase{name="good",namespace="ns",phase="Available"} 1"#), "{text}");
    }
}
