//! The misbehaving prefill of a `testing` build (`KVGATE_INJECT_FAULT`, and the restart fault of
//! `handoff/restart_fault.rs`): a route around the honest one (`prefill.rs`), chosen at
//! start-up, that picks which handoffs get the fault and sends those through the fault
//! decorator (`handoff/faulty.rs`). Builds without `testing` compile none of it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use kvgate_proto::roles::PrefillRequest;
use tracing::Instrument;

use super::prefill::{self, Failed, Honest, PrefillRole, Via};
use crate::handoff::faults::{self, Fault, Injection};
use crate::handoff::faulty::Faulty;
use crate::handoff::restart_fault;
use crate::handoff::sender::{KvConnection, SendError, SendOutcome, Transfer};

/// Which handoffs get which fault.
pub struct Injector {
    fault: Option<Fault>,
    /// The fault hits handoffs number `after + every`, `after + 2 * every`, ... (from 1).
    every: u64,
    after: u64,
    handoffs: AtomicU64,
    /// A dedicated prefill process really exits for `die-mid-transfer`; `local` drops the
    /// connection instead (its other roles share the process).
    exit_on_death: bool,
}

impl Injector {
    /// The injector the environment's fault and the restart fault ask for; `None`: this
    /// worker is honest.
    pub fn new(injection: Option<Injection>, exit_on_death: bool) -> Option<Injector> {
        if injection.is_none() && restart_fault::after().is_none() {
            return None;
        }
        if let Some(i) = injection {
            tracing::warn!(fault = ?i.fault, every = i.every, after = i.after, "FAULT INJECTION ENABLED: this prefill worker breaks the handoff protocol on purpose");
        }
        let (fault, every, after) = injection.map_or((None, 1, 0), |i| (Some(i.fault), i.every, i.after));
        Some(Injector { fault, every, after, handoffs: AtomicU64::new(0), exit_on_death })
    }
}

pub fn routes(role: PrefillRole, injector: Injector) -> Router {
    Router::new().route(super::PREFILL_PATH, post(serve)).with_state((Arc::new(role), Arc::new(injector)))
}

async fn serve(State((role, injector)): State<(Arc<PrefillRole>, Arc<Injector>)>, body: Bytes) -> Response {
    let (req, span) = match prefill::request(&body) {
        Ok(r) => r,
        Err(refused) => return refused.into_response(),
    };
    let n = injector.handoffs.fetch_add(1, Ordering::SeqCst) + 1;
    let fault = injector.fault.filter(|_| faults::hits(n, injector.after, injector.every));
    let response = match fault {
        None => prefill::handle(role, req, &Honest).instrument(span).await,
        Some(Fault::IgnoreRejection) => ignore_rejection(role, req, injector.exit_on_death).instrument(span).await,
        Some(fault) => prefill::handle(role, req, &Faulted { fault, exit_on_death: injector.exit_on_death }).instrument(span).await,
    };
    restart_fault::handoff_done(n);
    response
}

/// The incident's bug: a prompt that fits is served as any other; one that cannot is rejected,
/// yet a one-token placeholder is computed and handed off for it anyway, after the rejection
/// went out, claiming the whole prompt (its lease is not the reservation's: the reservation
/// check that honest prefill makes first is skipped).
async fn ignore_rejection(role: Arc<PrefillRole>, req: PrefillRequest, exit_on_death: bool) -> Response {
    if let Err(refused) = prefill::vocabulary(&role, &req) {
        return refused.into_response();
    }
    let Some(r) = prefill::rejection(&role, &req) else { return prefill::handle(role, req, &Honest).await };
    if !req.prompt.is_empty() {
        let role = role.clone();
        let mut placeholder = req;
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            placeholder.prompt.truncate(1);
            let _: Result<_, Failed> = prefill::run(&role, &placeholder, &Faulted { fault: Fault::IgnoreRejection, exit_on_death }).await;
        });
    }
    prefill::refuse(&role, r)
}

/// The transfer through the fault decorator.
struct Faulted {
    fault: Fault,
    exit_on_death: bool,
}

impl Via for Faulted {
    fn claims(&self, computed: usize, req: &PrefillRequest) -> usize {
        // The placeholder's one token of KV, claimed as the whole reserved prompt.
        if self.fault == Fault::IgnoreRejection { req.reservation.reserved_tokens as usize } else { computed }
    }

    async fn send<'t>(&'t self, transfer: &'t Transfer<'t>) -> Result<SendOutcome, SendError> {
        let port = KvConnection::new(&transfer.reservation.kv_addr, transfer.metrics);
        let outcome = transfer.run_into(Faulty::new(self.fault, port, transfer.secret, transfer.reservation, transfer.tenant)).await;
        if matches!(outcome, Ok(SendOutcome::Died)) && self.exit_on_death {
            tracing::error!("die-mid-transfer: exiting mid-transfer as instructed");
            std::process::exit(137);
        }
        outcome
    }
}
