//! Connection places of a listener: a total and a share per client address, where a full pool
//! never simply closes the newcomer.
//!
//! Closing the newest connection at a per-address cap made honest bursts fail: the router opens
//! one connection per call in flight to each peer and a prefill peer one KV connection per
//! handoff, all from one address, so a burst met the cap (`Broken pipe` on prefill, 502 at the
//! router); and a stranger sharing that address (pods with `hostNetwork` on one node) could lock
//! the peer out with idle sockets. What tells the two apart is behaviour: an honest client sends
//! its request (or its authenticating frame) right after connecting; an idle socket sends
//! nothing. So, at a full pool:
//!
//! - a newcomer that has **sent bytes** takes the place of the **oldest idle** holder of its
//!   address (of any address when the total is full), told to close: one with nothing in
//!   progress (no request in flight; on the KV port, not yet authenticated) for at least
//!   [`GRACE`]; when there is none, it waits for a place until its deadline;
//! - a newcomer that has sent **nothing** within [`GRACE`] is closed, as before.
//!
//! Newcomers that spoke and wait are bounded in all.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// How long a holder with nothing in progress keeps its place against newcomers, and how long
/// a newcomer at a full pool may stay silent: far longer than an honest client takes to send
/// what it connected for, far shorter than any idle deadline.
pub const GRACE: Duration = Duration::from_millis(50);

/// How often a waiting newcomer looks again for an idle holder (a freed place wakes it at once).
const RETRY: Duration = Duration::from_millis(10);

/// Why a newcomer got no place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoPlace {
    /// Its address held its share (of busy places) until the deadline, or it sent nothing.
    Client,
    /// Every place was busy until the deadline, or too many newcomers were waiting already.
    Total,
}

/// How a newcomer got its place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admitted {
    /// A free one.
    Free,
    /// An idle holder's, which was told to close.
    Evicted,
    /// One freed while it waited.
    Waited,
}

/// The caps of a pool.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    pub total: usize,
    pub per_client: usize,
    /// Newcomers that may wait for a place at once.
    pub waiting: usize,
}

/// What a holder is doing: work in progress (requests in flight), and since when it has had
/// none (milliseconds from the pool's epoch).
#[derive(Debug)]
pub struct Activity {
    epoch: Instant,
    busy: AtomicUsize,
    idle_since_ms: AtomicU64,
}

impl Activity {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Marks work in progress until the returned guard is dropped.
    pub fn busy(self: &Arc<Self>) -> Busy {
        self.busy.fetch_add(1, Ordering::SeqCst);
        Busy(self.clone())
    }

    fn idle_for(&self) -> Option<Duration> {
        if self.busy.load(Ordering::SeqCst) > 0 {
            return None;
        }
        Some(Duration::from_millis(self.now_ms().saturating_sub(self.idle_since_ms.load(Ordering::SeqCst))))
    }
}

/// Work in progress on a place (a request in flight, until its response body is sent).
#[derive(Debug)]
pub struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.idle_since_ms.store(self.0.now_ms(), Ordering::SeqCst);
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

struct Held {
    id: u64,
    activity: Arc<Activity>,
    evict: Arc<Notify>,
}

impl Held {
    fn evictable(&self) -> bool {
        self.activity.idle_for().is_some_and(|idle| idle >= GRACE)
    }
}

#[derive(Default)]
struct Table {
    by_client: HashMap<IpAddr, VecDeque<Held>>,
    total: usize,
    waiting: usize,
    next_id: u64,
}

impl Table {
    /// Removes the oldest idle holder, of `client` or of anyone, and tells it to close.
    fn evict(&mut self, client: Option<IpAddr>) -> bool {
        let found = match client {
            Some(ip) => self.by_client.get(&ip).and_then(|q| q.iter().position(Held::evictable)).map(|at| (ip, at)),
            // Oldest by id, which grows with each place taken.
            None => {
                self.by_client.iter().filter_map(|(ip, q)| q.iter().position(Held::evictable).map(|at| (q[at].id, *ip, at))).min().map(|(_, ip, at)| (ip, at))
            }
        };
        let Some((ip, at)) = found else { return false };
        let queue = self.by_client.get_mut(&ip).expect("found above");
        let held = queue.remove(at).expect("found above");
        if queue.is_empty() {
            self.by_client.remove(&ip);
        }
        self.total -= 1;
        held.evict.notify_one();
        true
    }
}

/// One listener's places.
pub struct Places {
    caps: Caps,
    epoch: Instant,
    table: Mutex<Table>,
    freed: Notify,
}

/// A connection's place: given back when dropped, or taken over by a newcomer (which then
/// resolves [`Place::evicted`]).
pub struct Place {
    pool: Arc<Places>,
    client: IpAddr,
    id: u64,
    evict: Arc<Notify>,
    activity: Arc<Activity>,
}

impl Places {
    pub fn new(caps: Caps) -> Arc<Self> {
        Arc::new(Places { caps, epoch: Instant::now(), table: Mutex::new(Table::default()), freed: Notify::new() })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A free place now, or (with `evict`) an idle holder's.
    fn try_take(self: &Arc<Self>, client: IpAddr, evict: bool) -> Result<(Place, bool), NoPlace> {
        let mut t = self.lock();
        let mine = t.by_client.get(&client).map_or(0, VecDeque::len);
        let mut evicted = false;
        if mine >= self.caps.per_client {
            evicted = evict && t.evict(Some(client));
            if !evicted {
                return Err(NoPlace::Client);
            }
        } else if t.total >= self.caps.total {
            evicted = evict && t.evict(None);
            if !evicted {
                return Err(NoPlace::Total);
            }
        }
        let id = t.next_id;
        t.next_id += 1;
        let activity =
            Arc::new(Activity { epoch: self.epoch, busy: AtomicUsize::new(0), idle_since_ms: AtomicU64::new(self.epoch.elapsed().as_millis() as u64) });
        let evict = Arc::new(Notify::new());
        t.by_client.entry(client).or_default().push_back(Held { id, activity: activity.clone(), evict: evict.clone() });
        t.total += 1;
        Ok((Place { pool: self.clone(), client, id, evict, activity }, evicted))
    }

    /// A place for a newcomer from `client`. `spoke` resolves once the newcomer has sent
    /// something (its socket is readable); past `deadline` it gets none.
    pub async fn admit(self: &Arc<Self>, client: IpAddr, spoke: impl Future<Output = ()>, deadline: Instant) -> Result<(Place, Admitted), NoPlace> {
        let why = match self.try_take(client, false) {
            Ok((place, _)) => return Ok((place, Admitted::Free)),
            Err(why) => why,
        };
        // Only a newcomer that has said something competes for a place (so idle sockets,
        // however many, never crowd out those that spoke).
        if tokio::time::timeout_at(deadline.min(Instant::now() + GRACE), spoke).await.is_err() {
            return Err(why);
        }
        {
            let mut t = self.lock();
            if t.waiting >= self.caps.waiting {
                return Err(NoPlace::Total);
            }
            t.waiting += 1;
        }
        let _waiting = Waiting(self);
        loop {
            let freed = self.freed.notified();
            match self.try_take(client, true) {
                Ok((place, true)) => return Ok((place, Admitted::Evicted)),
                Ok((place, false)) => return Ok((place, Admitted::Waited)),
                Err(why) if Instant::now() >= deadline => return Err(why),
                Err(_) => {}
            }
            let _ = tokio::time::timeout_at((Instant::now() + RETRY).min(deadline), freed).await;
        }
    }

    /// Places held now.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.lock().total
    }
}

/// Counts a newcomer among the waiting for as long as it waits.
struct Waiting<'a>(&'a Places);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.lock().waiting -= 1;
    }
}

impl Place {
    /// Resolves when a newcomer took this place over: the connection must close.
    pub async fn evicted(&self) {
        self.evict.notified().await
    }

    /// What this place's connection is doing (marked busy while a request is in flight).
    pub fn activity(&self) -> &Arc<Activity> {
        &self.activity
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut t = self.pool.lock();
        let Some(queue) = t.by_client.get_mut(&self.client) else { return };
        // Not there when evicted: its place is the newcomer's already.
        let Some(at) = queue.iter().position(|h| h.id == self.id) else { return };
        queue.remove(at);
        if queue.is_empty() {
            t.by_client.remove(&self.client);
        }
        t.total -= 1;
        drop(t);
        self.pool.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    fn pool(total: usize, per_client: usize) -> Arc<Places> {
        Places::new(Caps { total, per_client, waiting: 4 })
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(2)
    }

    /// A newcomer that has sent something.
    async fn spoke() {}

    /// One that never does.
    async fn silent() {
        std::future::pending::<()>().await
    }

    #[tokio::test(start_paused = true)]
    async fn a_newcomer_that_spoke_takes_the_place_of_the_oldest_idle_holder_of_its_address() {
        let pool = pool(8, 2);
        let (first, _) = pool.admit(ip(1), spoke(), soon()).await.unwrap();
        tokio::time::advance(Duration::from_millis(10)).await;
        let (_second, _) = pool.admit(ip(1), spoke(), soon()).await.unwrap();
        tokio::time::advance(GRACE).await;
        let (_third, how) = pool.admit(ip(1), spoke(), soon()).await.unwrap();
        assert_eq!(how, Admitted::Evicted);
        tokio::time::timeout(Duration::from_millis(1), first.evicted()).await.expect("the oldest was told to close");
        drop(first);
        assert_eq!(pool.held(), 2, "an evicted place is not given back twice");
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_newcomer_at_a_full_pool_is_closed_after_the_grace() {
        let pool = pool(8, 1);
        let (_idle, _) = pool.admit(ip(1), spoke(), soon()).await.unwrap();
        tokio::time::advance(GRACE * 2).await;
        let started = Instant::now();
        assert_eq!(pool.admit(ip(1), silent(), soon()).await.err(), Some(NoPlace::Client));
        assert_eq!(started.elapsed(), GRACE, "it evicted nobody and waited no longer than the grace");
    }

    #[tokio::test(start_paused = true)]
    async fn a_busy_holder_keeps_its_place_and_the_newcomer_waits_for_it() {
        let pool = pool(8, 1);
        let (holder, _) = pool.admit(ip(1), spoke(), soon()).await.unwrap();
        let request = holder.activity().busy();
        tokio::time::advance(GRACE * 4).await;
        let waiter = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.admit(ip(1), spoke(), soon()).await.map(|(_, how)| how) })
        };
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(!waiter.is_finished(), "a request in flight is never cut for a newcomer");
        // The request ends; the connection idles past the grace, and then gives way.
        drop(request);
        assert_eq!(waiter.await.unwrap(), Ok(Admitted::Evicted));
    }

    #[tokio::test(start_paused = true)]
    async fn a_place_freed_while_waiting_goes_to_the_waiter() {
        let pool = pool(8, 1);
        let (young, _) = pool.admit(ip(1), spoke(), soon()).await.unwrap();
        let waiter = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.admit(ip(1), spoke(), soon()).await.map(|(_, how)| how) })
        };
        tokio::time::advance(Duration::from_millis(20)).await;
        drop(young); // authenticated (or closed) before its grace ended
        assert_eq!(waiter.await.unwrap(), Ok(Admitted::Waited));
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_ends_at_the_deadline_naming_the_cap() {
        for (other, why) in [(ip(1), NoPlace::Client), (ip(2), NoPlace::Total)] {
            let pool = pool(1, 1);
            let (held, _) = pool.admit(ip(1), spoke(), soon()).await.unwrap();
            let _request = held.activity().busy();
            assert_eq!(pool.admit(other, spoke(), Instant::now() + Duration::from_millis(200)).await.err(), Some(why));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_total_the_oldest_idle_place_of_any_address_goes() {
        let pool = pool(2, 2);
        let (a, _) = pool.admit(ip(1), spoke(), soon()).await.unwrap();
        tokio::time::advance(Duration::from_millis(5)).await;
        let (_b, _) = pool.admit(ip(2), spoke(), soon()).await.unwrap();
        tokio::time::advance(GRACE).await;
        let (_c, how) = pool.admit(ip(3), spoke(), soon()).await.unwrap();
        assert_eq!(how, Admitted::Evicted);
        tokio::time::timeout(Duration::from_millis(1), a.evicted()).await.expect("the oldest, of another address");
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_are_bounded() {
        let pool = pool(1, 1);
        let (held, _) = pool.admit(ip(1), spoke(), soon()).await.unwrap();
        let _request = held.activity().busy();
        let waiters: Vec<_> = (0..4)
            .map(|_| {
                let pool = pool.clone();
                tokio::spawn(async move { pool.admit(ip(1), spoke(), soon()).await.map(|_| ()) })
            })
            .collect();
        tokio::task::yield_now().await;
        assert_eq!(pool.admit(ip(1), spoke(), soon()).await.err(), Some(NoPlace::Total), "a fifth waiter is refused at once");
        for w in waiters {
            w.abort();
        }
    }
}
