//! The fault decorator (`testing` builds only): a `Sink` around decode's KV port that bends
//! exactly the one rule its fault names, on the frames passing through it, and leaves every
//! other frame as the honest sender sealed it. Chosen per handoff from `KVGATE_INJECT_FAULT`; the
//! sender itself has no fault branches.

use kvgate_proto::auth::FrameKey;
use kvgate_proto::handoff::{AckFrame, CommitFrame, HandoffId, TenantTag};
use kvgate_proto::roles::Reservation;

use super::Secret;
use super::faults::Fault;
use super::sender::{Flow, OutgoingPage, SendError, Sink};

pub struct Faulty<S> {
    fault: Fault,
    inner: S,
    /// The handoff's frame key, to re-seal a page the fault changed.
    key: FrameKey,
    /// A key that is not the handoff's (the wrong-auth fault signs with it).
    wrong_key: FrameKey,
    /// Another tenant, and the handoff's key for it (the wrong-tenant fault seals with them).
    other_tenant: (TenantTag, FrameKey),
    /// Pages in the transfer: the page-level faults hit the middle one.
    pages: usize,
    /// When the reservation expires (Unix milliseconds): the stall outlasts it.
    expires_ms: u64,
}

impl<S: Sink> Faulty<S> {
    pub fn new(fault: Fault, inner: S, secret: &Secret, reservation: &Reservation, tenant: TenantTag) -> Self {
        let id = reservation.handoff_id;
        let key = secret.key().frame_key(id, tenant);
        let wrong_key = secret.key().frame_key(HandoffId(id.0 ^ 1), tenant);
        let other = TenantTag::of("kvgate-fault-other-tenant");
        Faulty {
            fault,
            inner,
            key,
            wrong_key,
            other_tenant: (other, secret.key().frame_key(id, other)),
            pages: reservation.pages.len(),
            expires_ms: reservation.expires_ms,
        }
    }
}

/// From now until 100 ms after `expires_ms` (Unix milliseconds).
fn until_past(expires_ms: u64) -> std::time::Duration {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    std::time::Duration::from_millis(expires_ms + 100).saturating_sub(now)
}

impl<S: Sink> Sink for Faulty<S> {
    fn flow(&mut self, i: usize, n: usize) -> Flow {
        match self.fault {
            // One page, then a commit claiming the whole prompt (the incident). The
            // ignore-rejection placeholder holds one token of KV for a whole prompt's pages.
            Fault::TruncateTransfer | Fault::IgnoreRejection if i >= 1 => Flow::Stop,
            Fault::DieMidTransfer if i >= n.div_ceil(2).max(1) => Flow::Die,
            _ => self.inner.flow(i, n),
        }
    }

    async fn page(&mut self, frame: &mut OutgoingPage<'_>) -> Result<(), SendError> {
        let middle = frame.fields.index as usize == self.pages / 2;
        match self.fault {
            Fault::DropPage if middle => {
                // Lands outside the reservation; the reserved page stays unwritten.
                frame.fields.page = u32::MAX;
                frame.seal(Some(&self.key))?;
            }
            Fault::CorruptPage if middle => {
                // A sender whose memory went bad after the page was sealed: its MAC holds, its
                // tag no longer matches the payload (a `checksum` refusal, not `auth`).
                frame.payload_mut()?[0] ^= 0x01;
            }
            Fault::WrongLayout => {
                // K and V swapped: every tag, MAC and fingerprint holds, the KV is wrong.
                let payload = frame.payload_mut()?;
                let half = payload.len() / 2;
                payload.rotate_left(half);
                frame.seal(Some(&self.key))?;
            }
            Fault::WrongAuth => frame.seal(Some(&self.wrong_key))?,
            Fault::WrongTenant => {
                // KV computed for another tenant's request, sealed as that tenant's: every MAC
                // and tag holds; only the tenant is not the reservation's.
                frame.fields.tenant = self.other_tenant.0;
                frame.seal(Some(&self.other_tenant.1))?;
            }
            Fault::DuplicatePage if middle => self.inner.page(frame).await?,
            Fault::StallMidTransfer if middle => tokio::time::sleep(until_past(self.expires_ms)).await,
            _ => {}
        }
        self.inner.page(frame).await
    }

    async fn commit(&mut self, mut commit: CommitFrame, key: Option<&FrameKey>) -> Result<(), SendError> {
        match self.fault {
            Fault::WrongFingerprint => commit.model_fingerprint ^= 1,
            Fault::WrongAuth => return self.inner.commit(commit, Some(&self.wrong_key)).await,
            Fault::WrongTenant => {
                commit.tenant = self.other_tenant.0;
                return self.inner.commit(commit, Some(&self.other_tenant.1)).await;
            }
            _ => {}
        }
        self.inner.commit(commit, key).await
    }

    async fn ack(self) -> Result<AckFrame, SendError> {
        self.inner.ack().await
    }

    async fn abandon(self) -> Result<(), SendError> {
        self.inner.abandon().await
    }
}
