//! Decode's table of reservations: their state (open, committed, failed, expired), their pages
//! and deadlines, and the verdict of each. The integrity rules themselves are `verify.rs`; this
//! file applies them to the frames that arrive, before anything is decoded.
//!
//! Two kinds of refusal are kept apart. *Integrity* refusals (`kvgate_handoff_mismatch_total`)
//! are evidence that KV was missing, corrupt, forged or sent where it must not go: an
//! authenticated frame that breaks a rule, or a transfer that stopped half way. *Protocol*
//! refusals (`kvgate_kv_port_rejected_total`) are bytes nobody with the secret sent: they are
//! abuse or noise, and never fire the integrity alert. A reservation nobody ever sent a frame for
//! only counts as expired.

use kvgate_proto::logprobs::TokenLogprobs;
use kvgate_proto::tenant_id::TenantId;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvgate_proto::auth::FrameKey;
use kvgate_proto::auth::{Mac, ReservationFields};
use kvgate_proto::handoff::{CommitFrame, Frame, HEADER_LEN, HandoffId, PageFields, TenantTag};
use kvgate_proto::refusal::{Mismatch, PortRefusal, Refusal};
use kvgate_telemetry::TraceContext;
use tokio::sync::Notify;

use super::auth::Secret;
use super::metrics::HandoffMetrics;
use super::verify::{self, Refused, Rules, Transfer};
use crate::kv::{AllocError, KvError, KvPool, Lease};

/// Why a transfer was refused: the `reason` label and a message for the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandoffRefusal {
    pub reason: Refusal,
    pub message: String,
}

impl HandoffRefusal {
    pub fn new(reason: impl Into<Refusal>, message: String) -> Self {
        HandoffRefusal { reason: reason.into(), message }
    }

    /// A frame whose MAC does not verify for a handoff that is not open: nobody holding the
    /// secret sent it (a protocol refusal, not an integrity one).
    fn unauthenticated(id: HandoffId) -> Self {
        HandoffRefusal::new(PortRefusal::Unauthenticated, format!("kv_port_unauthenticated: a frame for handoff {id} does not carry its MAC"))
    }

    /// The integrity mismatch it is, if it is one.
    pub fn mismatch(&self) -> Option<Mismatch> {
        match self.reason {
            Refusal::Mismatch(m) => Some(m),
            _ => None,
        }
    }
}

impl From<Refused> for HandoffRefusal {
    fn from(r: Refused) -> Self {
        HandoffRefusal::new(r.mismatch, r.message)
    }
}

/// Whose request a handoff serves: its trace, and the tenant it was reserved for (on the
/// receipt's span and every line logged under it).
#[derive(Debug, Clone)]
pub struct Origin {
    pub trace: TraceContext,
    pub tenant: TenantId,
}

/// A verified transfer, ready to decode.
#[derive(Debug)]
pub struct Committed {
    pub lease: Lease,
    pub first_token: u32,
    pub first_logprobs: Option<TokenLogprobs>,
    pub reserved_tokens: u32,
    /// Most tokens generate may ask for: what the reservation has room for.
    pub max_tokens: u32,
    /// The tenant it was reserved for: only that tenant's generate call may take it.
    pub tenant: TenantId,
    /// A committed handoff nobody asks to decode is freed at the reservation's deadline too.
    deadline: Instant,
}

struct Open {
    /// Shared with page writes in flight, which run outside the table's lock.
    lease: Arc<Lease>,
    max_tokens: u32,
    deadline: Instant,
    created: Instant,
    transfer: Transfer,
    tenant: TenantId,
}

impl Open {
    fn pages_received(&self) -> usize {
        self.transfer.pages_received()
    }

    fn pages(&self) -> usize {
        self.transfer.pages.len()
    }
}

enum Entry {
    Open(Open),
    Committed(Committed),
    /// Tombstones: kept (bounded) so late or replayed frames get the right reason.
    Failed(HandoffRefusal),
    Cancelled {
        rejected: bool,
    },
    /// `counted`: a timeout mismatch was already counted for it (pages had arrived), so a late
    /// frame of the same transfer does not count it twice.
    Expired {
        counted: bool,
    },
}

/// How many finished handoffs are remembered.
const TOMBSTONES: usize = 4096;

/// Why nothing was reserved.
#[derive(Debug, PartialEq, Eq)]
pub enum ReserveError {
    /// A field is out of range (zero tokens, or a sum that overflows).
    Invalid {
        field: &'static str,
        message: String,
    },
    /// Prompt plus completion exceed the declared window.
    ContextLength {
        prompt: u32,
        max_tokens: u32,
        window: usize,
    },
    /// Too many reservations are open or committed and not yet decoded.
    TooMany {
        open: usize,
        limit: usize,
    },
    NeverFits {
        needed: usize,
        capacity: usize,
    },
    NoRoom {
        needed: usize,
        free: usize,
    },
}

/// A page frame's slot, taken before its payload is read ([`Reservations::claim_page`]).
pub struct PageClaim {
    fields: PageFields,
    /// The tag the frame carries.
    tag: u128,
    lease: Arc<Lease>,
}

/// What the reservation tells prefill.
#[derive(Debug, Clone)]
pub struct Issued {
    pub id: HandoffId,
    pub pages: Vec<u32>,
    pub reserved_tokens: u32,
    pub max_tokens: u32,
    pub expires_ms: u64,
    pub tag: Mac,
    pub tenant: TenantId,
}

/// Bounds every reservation is checked against.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The declared context window: prompt + completion tokens of one request.
    pub window: usize,
    /// The model's vocabulary: a committed first token must be a token.
    pub vocab: usize,
    /// Most reservations open or committed at once.
    pub max_open: usize,
}

pub struct Reservations {
    pool: Arc<KvPool>,
    secret: Secret,
    timeout: Duration,
    limits: Limits,
    /// The KV port prefill must send to; covered by each reservation's tag.
    kv_addr: String,
    rules: Rules,
    pub metrics: HandoffMetrics,
    table: Mutex<Table>,
    changed: Notify,
}

#[derive(Default)]
struct Table {
    entries: HashMap<HandoffId, Entry>,
    finished: VecDeque<HandoffId>,
    /// The trace and tenant of each handoff's request, while its entry is remembered (a late
    /// frame of a cancelled or failed handoff is still logged under its request's trace).
    traces: HashMap<HandoffId, Origin>,
}

impl Table {
    /// The tenant handoff `id` was reserved for, while anything of it is remembered.
    fn tenant_of(&self, id: HandoffId) -> Option<TenantId> {
        match self.entries.get(&id) {
            Some(Entry::Open(o)) => Some(o.tenant.clone()),
            Some(Entry::Committed(c)) => Some(c.tenant.clone()),
            _ => self.traces.get(&id).map(|o| o.tenant.clone()),
        }
    }

    fn tombstone(&mut self, id: HandoffId, entry: Entry) {
        self.entries.insert(id, entry);
        self.finished.push_back(id);
        while self.finished.len() > TOMBSTONES {
            if let Some(old) = self.finished.pop_front()
                && matches!(self.entries.get(&old), Some(Entry::Failed(_) | Entry::Cancelled { .. } | Entry::Expired { .. }))
            {
                self.entries.remove(&old);
                self.traces.remove(&old);
            }
        }
    }

    fn live(&self) -> usize {
        self.entries.values().filter(|e| matches!(e, Entry::Open(_) | Entry::Committed(_))).count()
    }
}

/// A model or layout fingerprint (16 hex digits) as the commit frame carries it. Anything else
/// is an error, never some number that might match another malformed one.
pub fn fingerprint_u64(hex: &str) -> Result<u64, String> {
    match hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        true => u64::from_str_radix(hex, 16).map_err(|e| e.to_string()),
        false => Err(format!("a fingerprint is 16 hex digits, got {hex:?}")),
    }
}

/// Everything `Reservations` is built from besides the pool and the secret.
#[derive(Debug, Clone)]
pub struct TableConfig {
    pub timeout: Duration,
    pub limits: Limits,
    pub kv_addr: String,
    pub model_fingerprint: String,
    pub layout_fingerprint: String,
}

impl Reservations {
    /// The table; an error when a fingerprint of `config` is malformed.
    pub fn new(pool: Arc<KvPool>, secret: Secret, config: TableConfig, metrics: HandoffMetrics) -> Result<Self, String> {
        let layout = pool.layout();
        let rules = Rules {
            page_size: layout.page_size as u32,
            page_bytes: layout.page_bytes(),
            vocab: config.limits.vocab,
            model_fingerprint: fingerprint_u64(&config.model_fingerprint).map_err(|e| format!("model fingerprint: {e}"))?,
            layout_fingerprint: fingerprint_u64(&config.layout_fingerprint).map_err(|e| format!("layout fingerprint: {e}"))?,
            integrity: true,
        };
        Ok(Reservations {
            pool,
            secret,
            timeout: config.timeout,
            limits: config.limits,
            kv_addr: config.kv_addr,
            rules,
            metrics,
            table: Mutex::new(Table::default()),
            changed: Notify::new(),
        })
    }

    /// Skips the MAC, page tag and digest checks. Only for measuring their cost in
    /// `benches/handoff.rs`; no command line flag reaches it, and only a build with the
    /// `testing` feature has it.
    #[cfg(feature = "testing")]
    pub fn without_integrity_checks(mut self) -> Self {
        self.rules.integrity = false;
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn page_bytes(&self) -> usize {
        self.pool.layout().page_bytes()
    }

    pub fn kv_addr(&self) -> &str {
        &self.kv_addr
    }

    /// Whether a frame, as read (`header` and `body`), carries the MAC of its handoff's frame
    /// key. With integrity checks off (the benchmark), every frame passes.
    pub fn authenticate(&self, frame: &Frame, header: &[u8; HEADER_LEN], body: &[u8]) -> bool {
        if !self.rules.integrity {
            return true;
        }
        match (frame.handoff(), frame.tenant()) {
            (Some(id), Some(tenant)) => frame.mac_verifies(&self.secret.key().frame_key(id, tenant), header, body),
            _ => false,
        }
    }

    /// The key a page frame of handoff `id` sealed for `tenant` must carry (its MAC and its
    /// tag); `None` with integrity checks off (the benchmark), where every frame passes. A frame
    /// that verifies under it is authentic; whether `tenant` is the reservation's is a rule.
    pub fn frame_key(&self, id: HandoffId, tenant: TenantTag) -> Option<FrameKey> {
        self.rules.integrity.then(|| self.secret.key().frame_key(id, tenant))
    }

    /// Reserves pages for `prompt + max_tokens` tokens; the transfer must fill the first
    /// `prompt` of them. Nothing is reserved when the answer is an error.
    pub fn reserve(&self, prompt: u32, max_tokens: u32, tenant: &TenantId) -> Result<Issued, ReserveError> {
        if prompt == 0 {
            return Err(ReserveError::Invalid { field: "prompt_tokens", message: "`prompt_tokens` must be at least 1".into() });
        }
        if max_tokens == 0 {
            return Err(ReserveError::Invalid { field: "max_tokens", message: "`max_tokens` must be at least 1".into() });
        }
        let total = prompt.checked_add(max_tokens).ok_or_else(|| ReserveError::Invalid {
            field: "max_tokens",
            message: format!("`prompt_tokens` + `max_tokens` ({prompt} + {max_tokens}) overflows"),
        })?;
        if total as usize > self.limits.window {
            return Err(ReserveError::ContextLength { prompt, max_tokens, window: self.limits.window });
        }
        let page = self.pool.layout().page_size;
        let mut table = self.lock();
        let open = table.live();
        if open >= self.limits.max_open {
            return Err(ReserveError::TooMany { open, limit: self.limits.max_open });
        }
        let lease = self.pool.lease(total as usize).map_err(|e| match e {
            AllocError::NeverFits { requested, total } => ReserveError::NeverFits { needed: requested * page, capacity: total * page },
            AllocError::Insufficient { requested, free } => ReserveError::NoRoom { needed: requested * page, free: free * page },
        })?;
        let id = HandoffId(rand::random());
        let pages: Vec<u32> = lease.pages().iter().take(self.pool.layout().pages_for(prompt as usize)).map(|p| p.id).collect();
        let expires_ms = kvgate_proto::auth::now_ms() + self.timeout.as_millis() as u64;
        let tag_of_tenant = tenant.tag();
        let fields =
            ReservationFields { handoff: id, reserved_tokens: prompt, max_tokens, expires_ms, pages: &pages, kv_addr: &self.kv_addr, tenant: tag_of_tenant };
        let tag = self.secret.key().reservation_tag(&fields);
        let now = Instant::now();
        let transfer = Transfer::new(tag_of_tenant, pages.clone(), prompt);
        let open = Open { lease: Arc::new(lease), max_tokens, deadline: now + self.timeout, created: now, transfer, tenant: tenant.clone() };
        table.entries.insert(id, Entry::Open(open));
        Ok(Issued { id, pages, reserved_tokens: prompt, max_tokens, expires_ms, tag, tenant: tenant.clone() })
    }

    /// Files open handoff `id` under its request's trace (with the tenant it was reserved for).
    pub fn set_trace(&self, id: HandoffId, trace: TraceContext) {
        let mut table = self.lock();
        if let Some(Entry::Open(open)) = table.entries.get(&id) {
            let origin = Origin { trace, tenant: open.tenant.clone() };
            table.traces.insert(id, origin);
        }
    }

    /// The trace and tenant of handoff `id`'s request, while the handoff is remembered.
    pub fn origin_of(&self, id: HandoffId) -> Option<Origin> {
        self.lock().traces.get(&id).cloned()
    }

    /// The verdict for an authenticated frame naming a handoff that is not open. It is counted
    /// once per transfer: a late frame of a handoff whose failure was already counted is not.
    fn not_open(&self, table: &mut Table, id: HandoffId) -> HandoffRefusal {
        let tenant = table.tenant_of(id);
        let (v, count) = match table.entries.get_mut(&id) {
            Some(Entry::Cancelled { rejected: true }) => (
                HandoffRefusal::new(
                    Mismatch::RejectedForwarded,
                    format!("kv_handoff_rejected_forwarded: handoff {id} was rejected and cancelled, but KV for it still arrived"),
                ),
                true,
            ),
            Some(Entry::Expired { counted }) => {
                let first = !std::mem::replace(counted, true);
                (HandoffRefusal::new(Mismatch::Timeout, format!("kv_handoff_timeout: reservation {id} expired before this frame arrived")), first)
            }
            Some(Entry::Failed(v)) => (v.clone(), false),
            Some(Entry::Committed(_)) => {
                (HandoffRefusal::new(Mismatch::UnknownHandoff, format!("kv_handoff_unknown: handoff {id} was already committed")), true)
            }
            _ => (HandoffRefusal::new(Mismatch::UnknownHandoff, format!("kv_handoff_unknown: no open reservation {id}")), true),
        };
        if count {
            self.count(&v, tenant.as_ref());
        }
        v
    }

    /// Fails an open handoff: its pages are freed (scrubbed) now and the verdict is kept for the
    /// router's generate call. `integrity` is false when nothing was ever sent for it (an unused
    /// reservation is no evidence of bad KV: it counts as expired, not as a mismatch).
    fn fail(&self, table: &mut Table, id: HandoffId, v: HandoffRefusal, integrity: bool) -> HandoffRefusal {
        let tenant = table.tenant_of(id);
        table.tombstone(id, Entry::Failed(v.clone()));
        if integrity {
            self.count(&v, tenant.as_ref());
        } else {
            self.metrics.expired.inc();
        }
        self.metrics.total.with_label_values(&["failed"]).inc();
        self.changed.notify_waiters();
        v
    }

    /// The open entry for an authenticated frame, or the verdict for it. A frame past the
    /// reservation's deadline fails it as timed out, whatever the sweeper has done so far.
    fn open_for<'t>(&self, table: &'t mut Table, id: HandoffId, authentic: bool) -> Result<&'t mut Open, HandoffRefusal> {
        match table.entries.get(&id) {
            Some(Entry::Open(_)) if !authentic => {
                // Someone who sees the live handoff on the wire tried to write into it.
                let v = HandoffRefusal::new(Mismatch::Auth, "kv_handoff_auth: a frame for this handoff does not carry its MAC (forged or altered)".into());
                return Err(self.fail(table, id, v, true));
            }
            Some(Entry::Open(open)) if open.deadline <= Instant::now() => {
                let got = open.pages_received();
                let v = HandoffRefusal::new(
                    Mismatch::Timeout,
                    format!("kv_handoff_timeout: reservation {id} expired ({got} of {} pages had arrived)", open.pages()),
                );
                return Err(self.fail(table, id, v, true));
            }
            Some(Entry::Open(_)) => {}
            _ if !authentic => {
                self.metrics.kv_port_rejected.with_label_values(&[PortRefusal::Unauthenticated.as_str()]).inc();
                return Err(HandoffRefusal::unauthenticated(id));
            }
            _ => return Err(self.not_open(table, id)),
        }
        match table.entries.get_mut(&id) {
            Some(Entry::Open(open)) => Ok(open),
            _ => unreachable!("checked above"),
        }
    }

    /// Takes a page frame's slot before its payload is read: the frame is authentic (`authentic`:
    /// its MAC verified) and passes every rule but its tag's, which [`Reservations::complete_page`]
    /// checks once the payload is in. Checked and taken under the table's lock; the payload is
    /// written outside it, so handoffs to the same decode fill their pages side by side.
    pub fn claim_page(&self, fields: &PageFields, tag: u128, authentic: bool) -> Result<PageClaim, HandoffRefusal> {
        let id = fields.handoff;
        let mut table = self.lock();
        let open = self.open_for(&mut table, id, authentic)?;
        if let Err(r) = verify::check_page_fields(&self.rules, &open.transfer, fields) {
            return Err(self.fail(&mut table, id, r.into(), true));
        }
        open.transfer.take(fields);
        Ok(PageClaim { fields: *fields, tag, lease: Arc::clone(&open.lease) })
    }

    /// Hands `fill` the claimed page from byte `offset` on, in place (`None` where pages are on a
    /// device: write staged bytes with [`Reservations::write_claimed`] instead).
    pub fn fill_claimed<R>(&self, claim: &PageClaim, offset: usize, fill: impl FnOnce(&mut [u8]) -> R) -> Result<Option<R>, HandoffRefusal> {
        self.pool.fill_host_page(&claim.lease, claim.fields.index as usize, offset, fill).map_err(|e| self.pool_failed(claim, e))
    }

    /// Writes `bytes` into the claimed page from byte `offset`.
    pub fn write_claimed(&self, claim: &PageClaim, offset: usize, bytes: &[u8]) -> Result<(), HandoffRefusal> {
        self.pool.write_page_at(&claim.lease, claim.fields.index as usize, offset, bytes).map_err(|e| self.pool_failed(claim, e))
    }

    /// Records a claimed page whose payload is in: when it matches the frame's tag
    /// (`payload_tag`: the tag of the payload as received) it counts as received; otherwise the
    /// handoff fails, and its pages, this one included, are scrubbed when they go back.
    pub fn complete_page(&self, claim: PageClaim, payload_tag: u128) -> Result<(), HandoffRefusal> {
        let id = claim.fields.handoff;
        let mut table = self.lock();
        let Some(Entry::Open(open)) = table.entries.get_mut(&id) else {
            // Failed or expired while the payload arrived.
            return Err(self.not_open(&mut table, id));
        };
        if let Err(r) = verify::check_page_tag(&self.rules, &claim.fields, claim.tag, payload_tag) {
            return Err(self.fail(&mut table, id, r.into(), true));
        }
        open.transfer.record(&claim.fields, claim.tag);
        self.metrics.bytes.inc_by(u64::from(claim.fields.payload_len));
        Ok(())
    }

    /// A whole page frame, already read: claimed, written and completed (the receiver streams
    /// pages in pieces instead; the table's tests drive it whole).
    #[cfg(test)]
    pub fn accept_page(&self, f: &kvgate_proto::handoff::PageView, authentic: bool, payload_tag: u128) -> Result<(), HandoffRefusal> {
        let claim = self.claim_page(&f.fields, f.tag, authentic)?;
        self.write_claimed(&claim, 0, f.payload)?;
        self.complete_page(claim, payload_tag)
    }

    /// A page the pool would not write: the handoff fails (a protocol mismatch).
    fn pool_failed(&self, claim: &PageClaim, e: KvError) -> HandoffRefusal {
        let v = HandoffRefusal::new(Mismatch::Protocol, format!("kv_handoff_protocol: {e}"));
        let mut table = self.lock();
        match table.entries.get(&claim.fields.handoff) {
            Some(Entry::Open(_)) => self.fail(&mut table, claim.fields.handoff, v, true),
            _ => v,
        }
    }

    /// Checks a commit against everything that arrived; on success the handoff may be decoded.
    pub fn accept_commit(&self, c: &CommitFrame, authentic: bool) -> Result<(), HandoffRefusal> {
        let mut table = self.lock();
        let open = self.open_for(&mut table, c.handoff, authentic)?;
        let check = verify::check_commit(&self.rules, &open.transfer, c);
        if let Err(r) = check {
            return Err(self.fail(&mut table, c.handoff, r.into(), true));
        }
        let Some(Entry::Open(open)) = table.entries.remove(&c.handoff) else { unreachable!("checked by open_for") };
        let Ok(lease) = Arc::try_unwrap(open.lease) else {
            // Only frames of another connection could still be writing: never decode over them.
            let v =
                HandoffRefusal::new(Mismatch::Protocol, "kv_handoff_protocol: a page of this handoff was still being written when its commit arrived".into());
            return Err(self.fail(&mut table, c.handoff, v, true));
        };
        self.metrics.duration.observe(open.created.elapsed().as_secs_f64());
        self.metrics.size.observe(open.transfer.received_bytes as f64);
        self.metrics.total.with_label_values(&["committed"]).inc();
        let committed = Committed {
            lease,
            first_token: c.first_token,
            first_logprobs: c.first_logprobs.clone(),
            reserved_tokens: open.transfer.reserved_tokens,
            max_tokens: open.max_tokens,
            tenant: open.tenant,
            deadline: open.deadline,
        };
        table.entries.insert(c.handoff, Entry::Committed(committed));
        self.changed.notify_waiters();
        Ok(())
    }

    /// Counts an integrity refusal under its reason and the tenant whose request it hit.
    fn count(&self, v: &HandoffRefusal, tenant: Option<&TenantId>) {
        if let Some(m) = v.mismatch() {
            self.metrics.mismatched(m, tenant.map(TenantId::as_str));
        }
    }

    /// The sender of an authenticated transfer vanished (or sent garbage) before committing.
    pub fn connection_lost(&self, id: HandoffId) {
        let mut table = self.lock();
        if let Some(Entry::Open(open)) = table.entries.get(&id) {
            let v = HandoffRefusal::new(
                Mismatch::Timeout,
                format!("kv_handoff_timeout: the prefill peer closed the KV connection after {} of {} pages", open.pages_received(), open.pages()),
            );
            let integrity = open.pages_received() > 0;
            self.fail(&mut table, id, v, integrity);
        }
    }

    /// Cancels an open reservation. Returns the verdict instead when the handoff already failed.
    pub fn cancel(&self, id: HandoffId, rejected: bool) -> Result<(), HandoffRefusal> {
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
            _ => Err(HandoffRefusal::new(Mismatch::UnknownHandoff, format!("kv_handoff_unknown: no open reservation {id}"))),
        }
    }

    /// Waits until the handoff is committed (and takes it) or has failed. Past `wait`, an
    /// uncommitted handoff is failed as timed out. A commit, a failure or a cancel wakes the
    /// waiter at once; otherwise it sleeps until the reservation's own deadline. Only `tenant`,
    /// the reservation's, may take it: another tenant's call fails the handoff (its pages are
    /// freed unread) as a `tenant` mismatch.
    pub async fn take_committed(&self, id: HandoffId, wait: Option<Duration>, tenant: &TenantId) -> Result<Committed, HandoffRefusal> {
        let give_up = wait.map(|w| Instant::now() + w);
        loop {
            if give_up.is_some_and(|t| Instant::now() >= t) {
                let mut table = self.lock();
                if let Some(Entry::Open(open)) = table.entries.get(&id) {
                    let got = open.pages_received();
                    let v = HandoffRefusal::new(
                        Mismatch::Timeout,
                        format!("kv_handoff_timeout: no commit from prefill ({got} of {} pages arrived) before the router gave up", open.pages()),
                    );
                    return Err(self.fail(&mut table, id, v, got > 0));
                }
            }
            let notified = self.changed.notified();
            let deadline = {
                let mut table = self.lock();
                match table.entries.get(&id) {
                    Some(Entry::Committed(c)) if &c.tenant != tenant => {
                        let v = HandoffRefusal::new(
                            Mismatch::Tenant,
                            format!("kv_handoff_tenant: handoff {id} was reserved for tenant `{}`, tenant `{tenant}` asked to decode it", c.tenant),
                        );
                        return Err(self.fail(&mut table, id, v, true));
                    }
                    Some(Entry::Committed(_)) => {
                        let Some(Entry::Committed(c)) = table.entries.remove(&id) else { unreachable!() };
                        table.traces.remove(&id);
                        return Ok(c);
                    }
                    Some(Entry::Open(open)) => open.deadline,
                    Some(Entry::Failed(v)) => return Err(v.clone()),
                    Some(Entry::Cancelled { .. }) => {
                        return Err(HandoffRefusal::new(Refusal::Cancelled, format!("kv_handoff_cancelled: handoff {id} was cancelled")));
                    }
                    Some(Entry::Expired { .. }) => {
                        return Err(HandoffRefusal::new(Mismatch::Timeout, format!("kv_handoff_timeout: reservation {id} expired without a commit")));
                    }
                    None => return Err(HandoffRefusal::new(Mismatch::UnknownHandoff, format!("kv_handoff_unknown: no reservation {id}"))),
                }
            };
            let wake = give_up.map_or(deadline, |g| g.min(deadline));
            if tokio::time::timeout_at(wake.into(), notified).await.is_err() && Instant::now() >= deadline {
                self.expire();
            }
        }
    }

    /// Frees reservations past their deadline. An open one that received pages is a timed-out
    /// transfer (a mismatch); one that received nothing, or a committed one nobody came to
    /// decode, is just expired.
    pub fn expire(&self) {
        let mut table = self.lock();
        let now = Instant::now();
        // (id, pages received while open) of every reservation past its deadline.
        let due: Vec<(HandoffId, usize)> = table
            .entries
            .iter()
            .filter_map(|(id, e)| match e {
                Entry::Open(o) if o.deadline <= now => Some((*id, o.pages_received())),
                Entry::Committed(c) if c.deadline <= now => Some((*id, 0)),
                _ => None,
            })
            .collect();
        for (id, got) in due {
            let was_open = matches!(table.entries.get(&id), Some(Entry::Open(_)));
            let tenant = table.tenant_of(id);
            table.tombstone(id, Entry::Expired { counted: got > 0 });
            self.metrics.expired.inc();
            if was_open {
                self.metrics.total.with_label_values(&["failed"]).inc();
                if got > 0 {
                    self.metrics.mismatched(Mismatch::Timeout, tenant.as_ref().map(TenantId::as_str));
                }
            }
        }
        self.changed.notify_waiters();
    }
}

#[cfg(test)]
#[path = "reservations_tests.rs"]
mod tests;
