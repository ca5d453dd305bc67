//! Decode's table of reservations: what each transfer must deliver, what has arrived, and the
//! verdict. Every integrity rule of the handoff is checked here, before anything is decoded.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvgate_proto::handoff::{CommitFrame, HandoffId, PageFrame};
use tokio::sync::Notify;
use xxhash_rust::xxh3::xxh3_64;

use super::auth::Secret;
use super::metrics::HandoffMetrics;
use crate::kv::{AllocError, KvPool, Lease};

/// Why a transfer was refused: the `reason` label and a message for the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub reason: &'static str,
    pub message: String,
}

impl Verdict {
    fn new(reason: &'static str, message: String) -> Self {
        Verdict { reason, message }
    }
}

/// A verified transfer, ready to decode.
#[derive(Debug)]
pub struct Committed {
    pub lease: Lease,
    pub first_token: u32,
    pub reserved_tokens: u32,
    /// A committed handoff nobody asks to decode is freed at the reservation's deadline too.
    deadline: Instant,
}

struct Open {
    lease: Lease,
    /// The tag minted at reservation; frames are compared with it in constant time.
    tag: [u8; 32],
    reserved_tokens: u32,
    pages: Vec<u32>,
    deadline: Instant,
    created: Instant,
    /// Checksum of each page index received so far.
    received: Vec<Option<u64>>,
    received_tokens: u32,
}

enum Entry {
    Open(Open),
    Committed(Committed),
    /// Tombstones: kept (bounded) so late or replayed frames get the right reason.
    Failed(Verdict),
    Cancelled { rejected: bool },
    Expired,
}

/// How many finished handoffs are remembered.
const TOMBSTONES: usize = 4096;

#[derive(Debug)]
pub enum ReserveError {
    NeverFits { needed: usize, capacity: usize },
    NoRoom { needed: usize, free: usize },
}

/// What the reservation tells prefill.
#[derive(Debug, Clone)]
pub struct Issued {
    pub id: HandoffId,
    pub pages: Vec<u32>,
    pub reserved_tokens: u32,
    pub expires_ms: u64,
    pub tag: [u8; 32],
}

pub struct Reservations {
    pool: Arc<KvPool>,
    secret: Secret,
    timeout: Duration,
    model_fingerprint: u64,
    layout_fingerprint: u64,
    pub metrics: HandoffMetrics,
    table: Mutex<Table>,
    changed: Notify,
    /// Off only in the benchmark that measures what the checks cost.
    verify_integrity: bool,
}

#[derive(Default)]
struct Table {
    entries: HashMap<HandoffId, Entry>,
    finished: VecDeque<HandoffId>,
}

impl Table {
    fn tombstone(&mut self, id: HandoffId, entry: Entry) {
        self.entries.insert(id, entry);
        self.finished.push_back(id);
        while self.finished.len() > TOMBSTONES {
            if let Some(old) = self.finished.pop_front()
                && matches!(self.entries.get(&old), Some(Entry::Failed(_) | Entry::Cancelled { .. } | Entry::Expired)) {
                    self.entries.remove(&old);
                }
        }
    }
}

/// Equality whose time does not depend on where the inputs differ.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

pub fn fingerprint_u64(hex: &str) -> u64 {
    u64::from_str_radix(hex, 16).unwrap_or(0)
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The digest a commit must carry: xxh3 over the page checksums in index order.
pub fn digest(checksums: impl IntoIterator<Item = u64>) -> u64 {
    let bytes: Vec<u8> = checksums.into_iter().flat_map(u64::to_le_bytes).collect();
    xxh3_64(&bytes)
}

impl Reservations {
    pub fn new(pool: Arc<KvPool>, secret: Secret, timeout: Duration, model_fp: &str, layout_fp: &str, metrics: HandoffMetrics) -> Self {
        Reservations {
            pool,
            secret,
            timeout,
            model_fingerprint: fingerprint_u64(model_fp),
            layout_fingerprint: fingerprint_u64(layout_fp),
            metrics,
            table: Mutex::new(Table::default()),
            changed: Notify::new(),
            verify_integrity: true,
        }
    }

    /// Skips the auth tag, checksum and digest checks. Only for measuring their cost in
    /// `benches/handoff.rs`; no command line flag reaches it.
    #[doc(hidden)]
    pub fn without_integrity_checks(mut self) -> Self {
        self.verify_integrity = false;
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn page_bytes(&self) -> usize {
        self.pool.layout().page_bytes()
    }

    /// Reserves pages for `prompt + max_tokens` tokens; the transfer must fill the first
    /// `prompt` of them. Nothing is reserved when the answer is an error.
    pub fn reserve(&self, prompt: u32, max_tokens: u32) -> Result<Issued, ReserveError> {
        let page = self.pool.layout().page_size;
        let lease = self.pool.lease((prompt + max_tokens) as usize).map_err(|e| match e {
            AllocError::NeverFits { requested, total } => ReserveError::NeverFits { needed: requested * page, capacity: total * page },
            AllocError::Insufficient { requested, free } => ReserveError::NoRoom { needed: requested * page, free: free * page },
        })?;
        let id = HandoffId(rand::random());
        let pages: Vec<u32> = lease.pages().iter().take(self.pool.layout().pages_for(prompt as usize)).map(|p| p.id).collect();
        let expires_ms = now_ms() + self.timeout.as_millis() as u64;
        let tag = self.secret.tag(id, prompt, expires_ms, &pages);
        let open = Open {
            tag,
            received: vec![None; pages.len()],
            lease,
            reserved_tokens: prompt,
            pages: pages.clone(),
            deadline: Instant::now() + self.timeout,
            created: Instant::now(),
            received_tokens: 0,
        };
        self.lock().entries.insert(id, Entry::Open(open));
        Ok(Issued { id, pages, reserved_tokens: prompt, expires_ms, tag })
    }

    /// The verdict for frames naming a handoff that is not open.
    fn not_open(&self, id: HandoffId, entry: Option<&Entry>) -> Verdict {
        let v = match entry {
            Some(Entry::Cancelled { rejected: true }) => Verdict::new(
                "rejected_forwarded",
                format!("kv_handoff_rejected_forwarded: handoff {id} was rejected and cancelled, but KV for it still arrived"),
            ),
            Some(Entry::Expired) => Verdict::new("timeout", format!("kv_handoff_timeout: reservation {id} expired before this frame arrived")),
            Some(Entry::Committed(_)) => Verdict::new("unknown_handoff", format!("kv_handoff_unknown: handoff {id} was already committed")),
            _ => Verdict::new("unknown_handoff", format!("kv_handoff_unknown: no open reservation {id}")),
        };
        self.metrics.mismatch.with_label_values(&[v.reason]).inc();
        v
    }

    /// Fails an open handoff: its pages are freed (scrubbed) now and the verdict is kept for the
    /// router's generate call.
    fn fail(&self, table: &mut Table, id: HandoffId, v: Verdict) -> Verdict {
        table.tombstone(id, Entry::Failed(v.clone()));
        self.metrics.mismatch.with_label_values(&[v.reason]).inc();
        self.metrics.total.with_label_values(&["failed"]).inc();
        self.changed.notify_waiters();
        v
    }

    /// Checks one page frame and, when it passes every check, writes it into its page.
    pub fn accept_page(&self, f: &PageFrame) -> Result<(), Verdict> {
        let mut table = self.lock();
        let Some(Entry::Open(open)) = table.entries.get_mut(&f.handoff) else {
            let entry = table.entries.get(&f.handoff);
            return Err(self.not_open(f.handoff, entry));
        };
        let check = (|| {
            if self.verify_integrity && !constant_time_eq(&f.tag, &open.tag) {
                return Err(Verdict::new("auth", "kv_handoff_auth: the frame's auth tag does not match the reservation".into()));
            }
            let i = f.index as usize;
            if open.pages.get(i) != Some(&f.page) {
                return Err(Verdict::new("page_set", format!("kv_handoff_page_set: page {} at index {i} is not part of the reservation", f.page)));
            }
            if open.received[i].is_some() {
                return Err(Verdict::new("page_set", format!("kv_handoff_page_set: page index {i} was sent twice")));
            }
            let page_size = self.pool.layout().page_size as u32;
            let expected = (open.reserved_tokens - f.index * page_size).min(page_size);
            if f.tokens != expected {
                return Err(Verdict::new("token_count", format!("kv_handoff_token_count: page index {i} carries {} tokens, {expected} reserved", f.tokens)));
            }
            if f.payload.len() != self.page_bytes() || (self.verify_integrity && xxh3_64(&f.payload) != f.checksum) {
                return Err(Verdict::new("checksum", format!("kv_handoff_checksum: page index {i} failed its checksum")));
            }
            self.pool.access().write_page(&open.lease, i, &f.payload).map_err(|e| Verdict::new("page_set", format!("kv_handoff_page_set: {e}")))?;
            open.received[i] = Some(f.checksum);
            open.received_tokens += f.tokens;
            Ok(())
        })();
        check.map_err(|v| self.fail(&mut table, f.handoff, v))?;
        self.metrics.bytes.inc_by(f.payload.len() as u64);
        Ok(())
    }

    /// Checks a commit against everything that arrived; on success the handoff may be decoded.
    pub fn accept_commit(&self, c: &CommitFrame) -> Result<(), Verdict> {
        let mut table = self.lock();
        let Some(Entry::Open(open)) = table.entries.get(&c.handoff) else {
            let entry = table.entries.get(&c.handoff);
            return Err(self.not_open(c.handoff, entry));
        };
        let check = || {
            if self.verify_integrity && !constant_time_eq(&c.tag, &open.tag) {
                return Err(Verdict::new("auth", "kv_handoff_auth: the commit's auth tag does not match the reservation".into()));
            }
            if c.model_fingerprint != self.model_fingerprint || c.layout_fingerprint != self.layout_fingerprint {
                return Err(Verdict::new(
                    "fingerprint",
                    format!(
                        "kv_handoff_fingerprint: sender model/layout {:016x}/{:016x} != decode {:016x}/{:016x}",
                        c.model_fingerprint, c.layout_fingerprint, self.model_fingerprint, self.layout_fingerprint
                    ),
                ));
            }
            if c.total_tokens != open.reserved_tokens || open.received_tokens != open.reserved_tokens {
                return Err(Verdict::new(
                    "token_count",
                    format!("kv_handoff_incomplete: received {} of {} reserved tokens", open.received_tokens, open.reserved_tokens),
                ));
            }
            let missing = open.received.iter().filter(|r| r.is_none()).count();
            if missing > 0 || c.page_count as usize != open.pages.len() {
                return Err(Verdict::new("page_set", format!("kv_handoff_page_set: {missing} of {} reserved pages never arrived", open.pages.len())));
            }
            if self.verify_integrity && digest(open.received.iter().map(|r| r.unwrap())) != c.digest {
                return Err(Verdict::new("checksum", "kv_handoff_checksum: the commit digest does not match the pages received".into()));
            }
            Ok(())
        };
        if let Err(v) = check() {
            return Err(self.fail(&mut table, c.handoff, v));
        }
        let Some(Entry::Open(open)) = table.entries.remove(&c.handoff) else { unreachable!() };
        self.metrics.duration.observe(open.created.elapsed().as_secs_f64());
        self.metrics.total.with_label_values(&["committed"]).inc();
        table.entries.insert(c.handoff, Entry::Committed(Committed {
                lease: open.lease,
                first_token: c.first_token,
                reserved_tokens: open.reserved_tokens,
                deadline: open.deadline,
            }));
        self.changed.notify_waiters();
        Ok(())
    }

    /// The sender vanished before committing.
    pub fn connection_lost(&self, id: HandoffId) {
        let mut table = self.lock();
        if let Some(Entry::Open(open)) = table.entries.get(&id) {
            let got = open.received.iter().filter(|r| r.is_some()).count();
            let v = Verdict::new("timeout", format!("kv_handoff_timeout: the prefill peer closed the KV connection after {got} of {} pages", open.pages.len()));
            self.fail(&mut table, id, v);
        }
    }

    /// Cancels an open reservation. Returns the verdict instead when the handoff already failed.
    pub fn cancel(&self, id: HandoffId, rejected: bool) -> Result<(), Verdict> {
        let mut table = self.lock();
        match table.entries.get(&id) {
            Some(Entry::Open(_) | Entry::Committed(_)) => {
                table.tombstone(id, Entry::Cancelled { rejected });
                self.metrics.cancelled.inc();
                if rejected {
                    self.metrics.total.with_label_values(&["rejected"]).inc();
                }
                self.changed.notify_waiters();
                Ok(())
            }
            Some(Entry::Failed(v)) => Err(v.clone()),
            _ => Err(Verdict::new("unknown_handoff", format!("kv_handoff_unknown: no open reservation {id}"))),
        }
    }

    /// Waits until the handoff is committed (and takes it) or has failed. Past `wait`, an
    /// uncommitted handoff is failed as timed out.
    pub async fn take_committed(&self, id: HandoffId, wait: Option<Duration>) -> Result<Committed, Verdict> {
        let give_up = wait.map(|w| Instant::now() + w);
        loop {
            if give_up.is_some_and(|t| Instant::now() >= t) {
                let mut table = self.lock();
                if let Some(Entry::Open(open)) = table.entries.get(&id) {
                    let got = open.received.iter().filter(|r| r.is_some()).count();
                    let v = Verdict::new(
                        "timeout",
                        format!("kv_handoff_timeout: no commit from prefill ({got} of {} pages arrived) before the router gave up", open.pages.len()),
                    );
                    return Err(self.fail(&mut table, id, v));
                }
            }
            let notified = self.changed.notified();
            {
                let mut table = self.lock();
                match table.entries.get(&id) {
                    Some(Entry::Committed(_)) => {
                        let Some(Entry::Committed(c)) = table.entries.remove(&id) else { unreachable!() };
                        return Ok(c);
                    }
                    Some(Entry::Open(_)) => {}
                    Some(Entry::Failed(v)) => return Err(v.clone()),
                    Some(Entry::Cancelled { .. }) => return Err(Verdict::new("cancelled", format!("kv_handoff_cancelled: handoff {id} was cancelled"))),
                    Some(Entry::Expired) => return Err(Verdict::new("timeout", format!("kv_handoff_timeout: reservation {id} expired without a commit"))),
                    None => return Err(Verdict::new("unknown_handoff", format!("kv_handoff_unknown: no reservation {id}"))),
                }
            }
            // Expiry is swept by `expire`; wake up at least that often.
            let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
            self.expire();
        }
    }

    /// Frees reservations past their deadline: uncommitted ones are timeouts; committed ones
    /// that nobody came to decode are just freed.
    pub fn expire(&self) {
        let mut table = self.lock();
        let now = Instant::now();
        // (id, committed?) of every reservation past its deadline.
        let due: Vec<(HandoffId, bool)> = table
            .entries
            .iter()
            .filter_map(|(id, e)| match e {
                Entry::Open(o) if o.deadline <= now => Some((*id, false)),
                Entry::Committed(c) if c.deadline <= now => Some((*id, true)),
                _ => None,
            })
            .collect();
        for (id, committed) in due {
            table.tombstone(id, Entry::Expired);
            self.metrics.expired.inc();
            if !committed {
                self.metrics.mismatch.with_label_values(&["timeout"]).inc();
                self.metrics.total.with_label_values(&["failed"]).inc();
            }
        }
        self.changed.notify_waiters();
    }

    /// Open or committed-but-not-yet-decoded reservations.
    pub fn live(&self) -> usize {
        self.lock().entries.values().filter(|e| matches!(e, Entry::Open(_) | Entry::Committed(_))).count()
    }
}
