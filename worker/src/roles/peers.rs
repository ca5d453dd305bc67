//! The router's view of its prefill and decode peers: capacity reports, load, and pairing
//! (only peers whose model and layout fingerprints agree may exchange pages).

use kvgate_proto::contract::KvRole;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kvgate_proto::auth::Instance;
use kvgate_proto::{CapacityReport, KV_POOL_PATH, PeerReport, PeerReports};

#[derive(Debug)]
pub struct Peer {
    /// `http://host:port`
    pub base: String,
    report: Mutex<Option<CapacityReport>>,
    in_flight: AtomicUsize,
}

/// Counts a request against a peer for as long as it lives.
#[derive(Debug)]
pub struct Busy(Arc<Peer>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Peer {
    pub fn new(addr: &str) -> Arc<Self> {
        let base = if addr.starts_with("http://") { addr.to_string() } else { format!("http://{addr}") };
        Arc::new(Peer { base, report: Mutex::new(None), in_flight: AtomicUsize::new(0) })
    }

    pub fn report(&self) -> Option<CapacityReport> {
        self.report.lock().unwrap().clone()
    }

    /// The worker process behind this address, as its last report named it (signed calls are
    /// good at that process only).
    pub fn instance(&self) -> Option<Instance> {
        self.report.lock().unwrap().as_ref()?.instance.parse().ok()
    }

    pub fn busy(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        Busy(self.clone())
    }

    fn load(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Re-reads this peer's capacity report (none when it does not answer).
    pub async fn refresh(&self, http: &reqwest::Client) {
        let fetched = async {
            let resp = http.get(format!("{}{KV_POOL_PATH}", self.base)).send().await.ok()?;
            resp.error_for_status().ok()?.json::<CapacityReport>().await.ok()
        }
        .await;
        *self.report.lock().unwrap() = fetched;
    }
}

/// Both roles' peers. The lists are fixed (`--prefill`/`--decode`) or replaced as discovery
/// sees EndpointSlices change (`--prefill-service`/`--decode-service`).
#[derive(Debug, Default)]
pub struct Peers {
    prefill: Mutex<Vec<Arc<Peer>>>,
    decode: Mutex<Vec<Arc<Peer>>>,
}

fn compatible(a: &CapacityReport, b: &CapacityReport) -> bool {
    a.model_fingerprint == b.model_fingerprint && a.layout_fingerprint == b.layout_fingerprint
}

impl Peers {
    pub fn new(prefill: &[String], decode: &[String]) -> Self {
        let peers = Peers::default();
        peers.set(KvRole::Prefill, prefill);
        peers.set(KvRole::Decode, decode);
        peers
    }

    fn list(&self, role: KvRole) -> &Mutex<Vec<Arc<Peer>>> {
        match role {
            KvRole::Prefill => &self.prefill,
            KvRole::Decode => &self.decode,
        }
    }

    fn snapshot(&self, role: KvRole) -> Vec<Arc<Peer>> {
        self.list(role).lock().unwrap().clone()
    }

    /// Replaces a role's peers with `addrs`, keeping what is known (report, load) of those that
    /// stay; returns the new ones, whose reports are still to be read.
    pub fn set(&self, role: KvRole, addrs: &[String]) -> Vec<Arc<Peer>> {
        let mut list = self.list(role).lock().unwrap();
        let mut added = Vec::new();
        let next: Vec<Arc<Peer>> = addrs
            .iter()
            .map(|a| {
                let fresh = Peer::new(a);
                list.iter().find(|p| p.base == fresh.base).cloned().unwrap_or_else(|| {
                    added.push(fresh.clone());
                    fresh
                })
            })
            .collect();
        *list = next;
        added
    }

    /// The last report read from every peer, per role, as a public port may show it: no
    /// addresses, no instances.
    pub fn reports(&self) -> PeerReports {
        let public = |r: CapacityReport| CapacityReport { instance: String::new(), ..r };
        let of = |role| self.snapshot(role).iter().map(|p| p.report()).map(|r| PeerReport { reachable: r.is_some(), report: r.map(public) }).collect();
        PeerReports { prefill: of(KvRole::Prefill), decode: of(KvRole::Decode) }
    }

    /// Re-reads every peer's capacity report; an unreachable peer has none and is not picked.
    pub async fn refresh(&self, http: &reqwest::Client) {
        for p in self.snapshot(KvRole::Prefill).iter().chain(&self.snapshot(KvRole::Decode)) {
            p.refresh(http).await;
        }
    }

    /// The least loaded decode peer, with the least loaded prefill peer that matches it.
    pub fn pick(&self) -> Option<(Arc<Peer>, Arc<Peer>)> {
        self.pick_avoiding(&[])
    }

    /// As [`Peers::pick`], preferring peers not in `avoid` (a retry's failed ones): a peer in
    /// it is taken only when no other of its role can make a pair.
    pub fn pick_avoiding(&self, avoid: &[Arc<Peer>]) -> Option<(Arc<Peer>, Arc<Peer>)> {
        let decode = self.snapshot(KvRole::Decode);
        let prefill = self.snapshot(KvRole::Prefill);
        let avoided = |p: &Arc<Peer>| avoid.iter().any(|a| Arc::ptr_eq(a, p));
        let mut decodes: Vec<(&Arc<Peer>, CapacityReport)> = decode.iter().filter_map(|d| d.report().map(|r| (d, r))).collect();
        decodes.sort_by_key(|(d, _)| (avoided(d), d.load()));
        for (d, dr) in decodes {
            let prefill = prefill.iter().filter(|p| p.report().is_some_and(|pr| compatible(&pr, &dr))).min_by_key(|p| (avoided(p), p.load()));
            if let Some(p) = prefill {
                return Some((p.clone(), d.clone()));
            }
        }
        None
    }

    /// Why `pick` found nothing, for the error a client sees.
    pub fn explain_no_pair(&self) -> String {
        let (prefill, decode) = (self.snapshot(KvRole::Prefill), self.snapshot(KvRole::Decode));
        let known = |ps: &[Arc<Peer>]| ps.iter().filter(|p| p.report().is_some()).count();
        format!(
            "no prefill/decode pair with matching model and KV layout fingerprints is available ({} of {} prefill and {} of {} decode peers reachable)",
            known(&prefill),
            prefill.len(),
            known(&decode),
            decode.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(fingerprint: &str) -> CapacityReport {
        CapacityReport {
            capacity_tokens: 64,
            page_size: 16,
            num_pages: 4,
            bytes_per_token: 8,
            device: "cpu".into(),
            dtype: "f32".into(),
            model: "tiny".into(),
            model_fingerprint: fingerprint.into(),
            layout_fingerprint: "l".into(),
            vocab_size: None,
            instance: String::new(),
            prefill_timings: None,
        }
    }

    #[test]
    fn a_retry_avoids_the_failed_peers_while_another_pair_exists() {
        let peers = Peers::new(&["p1".into(), "p2".into()], &["d1".into(), "d2".into()]);
        for p in peers.snapshot(KvRole::Prefill).iter().chain(&peers.snapshot(KvRole::Decode)) {
            *p.report.lock().unwrap() = Some(report("m"));
        }
        let (p, d) = peers.pick().unwrap();
        let (p2, d2) = peers.pick_avoiding(&[p.clone(), d.clone()]).unwrap();
        assert!(!Arc::ptr_eq(&p, &p2) && !Arc::ptr_eq(&d, &d2), "another pair: {} {}", p2.base, d2.base);
        // With every peer of a role avoided, the least loaded one serves all the same.
        let everyone: Vec<_> = peers.snapshot(KvRole::Prefill).into_iter().chain(peers.snapshot(KvRole::Decode)).collect();
        assert!(peers.pick_avoiding(&everyone).is_some());
    }
}
