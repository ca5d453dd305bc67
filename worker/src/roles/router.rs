//! The router role: admits against the declared window, reserves on decode, has prefill fill the
//! reservation, and streams decode's tokens back. Decode's verdict on the handoff is final: the
//! router never trusts prefill's word that a transfer completed. A request whose peer failed
//! before any byte reached the client is tried again on another pair (`retry.rs`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvgate_proto::auth::AuthError;
use kvgate_proto::logprobs::TokenLogprobs;
use kvgate_proto::roles::{CancelRequest, GenerateRequest, PrefillRequest, PrefillResponse, Reservation, ReserveRequest, Sampling, StreamLine};
use serde_json::Value;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tracing::Instrument;
use tracing::field::Empty;

use super::internal_auth::{REFUSED_HEADER, Signer};
use super::peers::{Peer, Peers};
use super::retry::{self, ATTEMPTS, Failed, Retries, Retry};
use super::router_codes::fail;
use crate::engine::admission::{self, Limits};
use crate::engine::{Event, Rejection};
use crate::metrics::Metrics;
use crate::model::SamplingParams;
use crate::server::RequestContext;
use kvgate_proto::codes::ErrorCode::{self, NoPeers, PeerError, PeerUnreachable};
use kvgate_telemetry::trace_context::mark_failed;

/// Counts a dispatch in `kvgate_num_requests_running` for as long as it lives.
struct Running(prometheus::IntGauge);

impl Running {
    fn start(gauge: &prometheus::IntGauge) -> Running {
        gauge.inc();
        Running(gauge.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The router role's backend: admits a request, picks a prefill/decode pair, reserves on decode,
/// has prefill compute and hand off, and relays decode's tokens.
pub struct Dispatcher {
    pub peers: Arc<Peers>,
    pub http: reqwest::Client,
    pub window: usize,
    pub metrics: Metrics,
    /// How long decode may wait for prefill's commit after prefill itself failed.
    pub grace: Duration,
    /// Signs every call to a peer with the deployment's request key.
    pub signer: Signer,
    pub retries: Retries,
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher").field("peers", &self.peers).finish()
    }
}

/// A peer's error body (OpenAI-style or a prefill verdict) as a failure.
async fn peer_error(resp: reqwest::Response, peer: &str) -> Event {
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    if let Value::Object(e) = &body["error"] {
        // A code this build does not know is the peer's error, not a guess.
        let code = e["code"].as_str().and_then(ErrorCode::parse).unwrap_or(PeerError);
        return fail(code, status, e["message"].as_str().unwrap_or(""));
    }
    // Decode's verdict, relayed by prefill: one of the closed set of refusal reasons.
    match serde_json::from_value::<PrefillResponse>(body) {
        Ok(PrefillResponse { refused: Some(r), message, .. }) => fail(ErrorCode::KvHandoff(r), status, message),
        _ => fail(PeerError, status, format!("{peer} answered HTTP {status}")),
    }
}

impl crate::server::Remote for Dispatcher {
    fn submit(
        self: Arc<Self>,
        prompt: Vec<u32>,
        max_tokens: usize,
        sampling: SamplingParams,
        request: &RequestContext,
    ) -> Result<UnboundedReceiver<Event>, Rejection> {
        Dispatcher::submit(&self, prompt, max_tokens, sampling, request)
    }

    fn can_serve(&self) -> bool {
        self.peers.pick().is_some()
    }

    fn reports(&self) -> kvgate_proto::PeerReports {
        self.peers.reports()
    }
}

impl Dispatcher {
    pub fn new(peers: Arc<Peers>, window: usize, metrics: Metrics, signer: Signer) -> Arc<Self> {
        // Idle connections are dropped before the peers' idle deadline closes them under us.
        let http = reqwest::Client::builder().connect_timeout(Duration::from_secs(5)).pool_idle_timeout(Duration::from_secs(5)).build().expect("HTTP client");
        let retries = Retries::new(&metrics.registry, &metrics.role);
        Arc::new(Dispatcher { peers, http, window, metrics, grace: Duration::from_secs(2), signer, retries })
    }

    /// Keeps the peers' capacity reports fresh.
    pub fn spawn_refresh(self: &Arc<Self>, every: Duration) {
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                this.peers.refresh(&this.http).await;
                tokio::time::sleep(every).await;
            }
        });
    }

    pub fn submit(
        self: &Arc<Self>,
        prompt: Vec<u32>,
        max_tokens: usize,
        sampling: SamplingParams,
        request: &RequestContext,
    ) -> Result<UnboundedReceiver<Event>, Rejection> {
        tracing::info_span!("admission", prompt_tokens = prompt.len() as i64, max_tokens = max_tokens as i64, window = self.window as i64)
            .in_scope(|| admission::admit(Limits { window: self.window, pool_tokens: usize::MAX }, prompt.len(), max_tokens))?;
        let (tx, rx) = unbounded_channel();
        let this = self.clone();
        let request = request.clone();
        // A child of the request's span, living as long as the dispatch does (a streamed
        // answer outlives the handler).
        let span = tracing::info_span!(
            "dispatch",
            handoff_id = Empty,
            prefill = Empty,
            decode = Empty,
            retries = Empty,
            otel.status_code = Empty,
            otel.status_description = Empty,
            error.type = Empty
        );
        tokio::spawn(
            async move {
                let _running = Running::start(&this.metrics.running);
                if let Err(event) = this.attempts(&tx, prompt, max_tokens, sampling, &request).await {
                    if let Event::Failed(f) = &event {
                        mark_failed(&tracing::Span::current(), &f.code.to_string());
                    }
                    let _ = tx.send(event);
                }
            }
            .instrument(span),
        );
        Ok(rx)
    }

    /// Up to [`ATTEMPTS`] attempts, each on a pair that avoids the peers that failed before;
    /// when all fail, the client sees the first failure (what happened to its request; the
    /// retries' failures are in the trace and the log).
    async fn attempts(
        &self,
        tx: &UnboundedSender<Event>,
        prompt: Vec<u32>,
        max_tokens: usize,
        sampling: SamplingParams,
        request: &RequestContext,
    ) -> Result<(), Event> {
        let job = Job { tx, prompt, max_tokens, sampling: Sampling::from(sampling), arrived: Instant::now(), request };
        let mut avoid: Vec<Arc<Peer>> = Vec::new();
        let mut first: Option<Event> = None;
        for attempt in 1..=ATTEMPTS {
            let failed = match self.orchestrate(&job, &avoid).await {
                Ok(()) => return Ok(()),
                Err(failed) => failed,
            };
            let Failed { event, retry } = failed;
            let detail = match &event {
                Event::Failed(f) => f.message.clone(),
                _ => String::new(),
            };
            first.get_or_insert(event);
            match retry {
                Some((why, failed_peers)) if attempt < ATTEMPTS => {
                    self.retries.count(why);
                    tracing::Span::current().record("retries", attempt as i64);
                    let reason: &str = why.into();
                    tracing::warn!(reason, attempt, detail = detail.as_str(), "a peer failed before any byte reached the client; trying another pair");
                    avoid.extend(failed_peers);
                    tokio::time::sleep(retry::backoff(attempt)).await;
                }
                _ => break,
            }
        }
        Err(first.expect("at least one attempt"))
    }

    /// A signed POST to `peer`. A peer that restarted since its report was read refuses the
    /// call as signed for another process (`wrong_target`): its report is read again and the
    /// call made once more (a refused call had no effect).
    async fn call(&self, peer: &Peer, path: &str, body: &impl serde::Serialize) -> reqwest::Result<reqwest::Response> {
        let send = |target| self.signer.post(&self.http, &peer.base, target, path, body).send();
        let target = peer.instance().unwrap_or(kvgate_proto::auth::Instance(0));
        let resp = send(target).await?;
        if resp.headers().get(REFUSED_HEADER).is_some_and(|r| r == AuthError::WrongTarget.reason()) {
            peer.refresh(&self.http).await;
            if let Some(fresh) = peer.instance().filter(|i| *i != target) {
                return send(fresh).await;
            }
        }
        Ok(resp)
    }

    /// Gives a reservation's pages back to decode (`rejected`: prefill refused the prompt as too
    /// large, so a transfer that still arrives is the incident's bug).
    async fn cancel(&self, decode: &Peer, id: kvgate_proto::handoff::HandoffId, rejected: bool, request: &RequestContext) {
        let body = CancelRequest { rejected, traceparent: Some(request.traceparent()) };
        let _ = self.call(decode, &super::cancel_path(id), &body).await;
    }

    /// One attempt on one prefill/decode pair (avoiding `avoid` where another pair exists):
    /// decode reserves, prefill fills the reservation, decode generates from it once verified.
    async fn orchestrate(&self, job: &Job<'_>, avoid: &[Arc<Peer>]) -> Result<(), Failed> {
        let pair = self.pair(avoid).await?;
        let reservation = self.reserve(job, &pair).await?;
        let id = reservation.handoff_id;
        tracing::Span::current().record("handoff_id", tracing::field::display(id));
        self.metrics.prompt_tokens.inc_by(job.prompt.len() as u64);
        match self.prefill(job, &pair, reservation).await? {
            Some(prefilled) => self.generate(job, &pair, id, prefilled).await,
            None => Ok(()), // the client left; the reservation is cancelled
        }
    }

    /// A ready pair avoiding `avoid` where another exists, recorded on the dispatch span.
    async fn pair(&self, avoid: &[Arc<Peer>]) -> Result<Pair, Failed> {
        if self.peers.pick().is_none() {
            self.peers.refresh(&self.http).await;
        }
        let (prefill, decode) = self.peers.pick_avoiding(avoid).ok_or_else(|| Failed::last(fail(NoPeers, 503, self.peers.explain_no_pair())))?;
        let dispatch = tracing::Span::current();
        dispatch.record("prefill", prefill.base.as_str());
        dispatch.record("decode", decode.base.as_str());
        Ok(Pair { _busy: (prefill.busy(), decode.busy()), prefill, decode })
    }

    /// Step 1: decode reserves pages for the whole sequence.
    async fn reserve(&self, job: &Job<'_>, pair: &Pair) -> Result<Reservation, Failed> {
        let (prompt_tokens, max_tokens) = (job.prompt.len(), job.max_tokens);
        async {
            let reserve = ReserveRequest {
                prompt_tokens: prompt_tokens as u32,
                max_tokens: max_tokens as u32,
                tenant: job.request.tenant.id(),
                traceparent: Some(job.request.traceparent()),
            };
            let resp = self.call_decode(&pair.decode, super::RESERVE_PATH, &reserve).await?;
            resp.json::<Reservation>()
                .await
                .map_err(|e| Failed::retry(fail(PeerError, 502, format!("decode reservation: {e}")), Retry::DecodeUnreachable, &[&pair.decode]))
        }
        .instrument(tracing::info_span!("reserve", prompt_tokens = prompt_tokens as i64, max_tokens = max_tokens as i64))
        .await
    }

    /// Step 2: prefill fills the reservation, or rejects the prompt before computing anything.
    /// `None` when the client left meanwhile (the reservation is then cancelled).
    async fn prefill(&self, job: &Job<'_>, pair: &Pair, reservation: Reservation) -> Result<Option<Prefilled>, Failed> {
        let (id, decode) = (reservation.handoff_id, &pair.decode);
        let span =
            tracing::info_span!("prefill", prompt_tokens = job.prompt.len() as i64, pages = reservation.pages.len() as i64, http.response.status_code = Empty);
        let call = async {
            let body = PrefillRequest {
                prompt: job.prompt.clone(),
                tenant: job.request.tenant.id(),
                reservation,
                sampling: Some(job.sampling),
                traceparent: Some(job.request.traceparent()),
            };
            self.call(&pair.prefill, super::PREFILL_PATH, &body).await
        };
        let prefilled = tokio::select! {
            r = call.instrument(span.clone()) => r,
            _ = job.tx.closed() => {
                // The client left: dropping the call stops prefill between chunks (its
                // connection closes), and decode's pages go back now, not at the deadline.
                self.metrics.abandoned.inc();
                tracing::info!("client disconnected during prefill; reservation cancelled");
                self.cancel(decode, id, false, job.request).await;
                return Ok(None);
            }
        };
        if let Ok(r) = &prefilled {
            span.record("http.response.status_code", i64::from(r.status().as_u16()));
        }
        Ok(Some(match prefilled {
            Ok(r) if r.status().is_client_error() || r.status() == reqwest::StatusCode::GATEWAY_TIMEOUT => {
                // Prefill refused (or ran out of time) before sending anything, so decode's
                // pages go back now. Only a prompt prefill can never hold is a *rejection*: a
                // transfer that still arrives for it is the incident's bug, and decode counts it
                // as such.
                let failure = peer_error(r, "prefill").await;
                let rejected = matches!(&failure, Event::Failed(f) if f.code == ErrorCode::PromptTooLarge);
                if let Event::Failed(f) = &failure {
                    mark_failed(&span, &f.code.to_string());
                }
                self.cancel(decode, id, rejected, job.request).await;
                return Err(Failed::last(failure));
            }
            Ok(r) if r.status().is_success() => {
                Prefilled { prompt_logprobs: r.json::<PrefillResponse>().await.ok().and_then(|p| p.prompt_logprobs), commit_wait: None, retry_as: None }
            }
            // Prefill failed or died: decode decides what happened to the transfer.
            Ok(r) => {
                let status = r.status().as_u16();
                let body = r.text().await.unwrap_or_default();
                // A body with a `reason` is decode's refusal of the transfer, relayed: final
                // unless it says the transfer was late (`retry::after_refusal`). Anything else
                // is prefill's own failure.
                let refused = serde_json::from_str::<PrefillResponse>(&body).ok().and_then(|p| p.refused);
                tracing::warn!(status, body, "prefill peer failed; asking decode for the verdict");
                Prefilled { prompt_logprobs: None, commit_wait: Some(self.grace), retry_as: refused.map_or(Some(Retry::PrefillFailed), retry::after_refusal) }
            }
            Err(e) => {
                tracing::warn!(error = %e, "prefill peer unreachable; asking decode for the verdict");
                Prefilled { prompt_logprobs: None, commit_wait: Some(self.grace), retry_as: Some(Retry::PrefillFailed) }
            }
        }))
    }

    /// Step 3: decode generates only from a verified handoff; its tokens are relayed to the client.
    async fn generate(&self, job: &Job<'_>, pair: &Pair, id: kvgate_proto::handoff::HandoffId, prefilled: Prefilled) -> Result<(), Failed> {
        let Prefilled { prompt_logprobs, commit_wait, retry_as } = prefilled;
        let (prefill, decode) = (&pair.prefill, &pair.decode);
        let span = tracing::info_span!("generate", completion_tokens = Empty, time_to_first_token = Empty, otel.status_code = Empty, otel.status_description = Empty, error.type = Empty);
        let mut delivered = false;
        let generated = async {
            let generate = GenerateRequest {
                prompt: job.prompt.clone(),
                tenant: job.request.tenant.id(),
                max_tokens: job.max_tokens as u32,
                sampling: job.sampling,
                commit_wait_ms: commit_wait.map(|d| d.as_millis() as u64),
                traceparent: Some(job.request.traceparent()),
            };
            let resp = self.call_decode(decode, &super::generate_path(id), &generate).await?;
            let held = job.request.delivery == crate::server::Delivery::Held;
            self.relay(job.tx, resp, job.arrived, prompt_logprobs, held, &mut delivered).await.map_err(|e| match e {
                // Decode's stream broke before anything reached the client (a held answer:
                // before it was done).
                Relay::Broke(event) if !delivered => Failed::retry(event, Retry::DecodeStreamBroke, &[decode]),
                Relay::Broke(event) | Relay::Failed(event) => Failed::last(event),
            })
        }
        .instrument(span.clone())
        .await;
        let failed = match generated {
            Ok(()) => return Ok(()),
            Err(failed) => failed,
        };
        if let Event::Failed(f) = &failed.event {
            mark_failed(&span, &f.code.to_string());
        }
        match failed {
            Failed { event: Event::Failed(f), .. } if f.code == PeerUnreachable => {
                let failed_peers: &[&Arc<Peer>] = if retry_as == Some(Retry::PrefillFailed) { &[prefill, decode] } else { &[decode] };
                Err(Failed::retry(Event::Failed(f), Retry::DecodeUnreachable, failed_peers))
            }
            // A late transfer may be either peer's doing: the next try avoids both.
            Failed { event, retry: None } if !delivered && retry_as == Some(Retry::HandoffTimeout) => {
                Err(Failed::retry(event, Retry::HandoffTimeout, &[prefill, decode]))
            }
            Failed { event, retry: None } if !delivered && retry_as.is_some() => Err(Failed::retry(event, Retry::PrefillFailed, &[prefill])),
            failed => Err(failed),
        }
    }

    /// POSTs `body` to decode; any answer but success becomes the failure decode described. A
    /// decode that does not answer at all may be tried again elsewhere.
    async fn call_decode(&self, decode: &Arc<Peer>, path: &str, body: &impl serde::Serialize) -> Result<reqwest::Response, Failed> {
        let resp = self
            .call(decode, path, body)
            .await
            .map_err(|e| Failed::retry(fail(PeerUnreachable, 502, format!("decode peer {}: {e}", decode.base)), Retry::DecodeUnreachable, &[decode]))?;
        if !resp.status().is_success() {
            return Err(Failed::last(peer_error(resp, "decode").await));
        }
        Ok(resp)
    }

    /// Forwards decode's NDJSON token stream as engine events.
    /// Relays decode's stream; prefill's prompt log-probabilities (when asked for) go just
    /// before the first token, as a colocated engine sends them.
    /// `delivered` turns true once an event went to the client.
    async fn relay(
        &self,
        tx: &UnboundedSender<Event>,
        resp: reqwest::Response,
        arrived: Instant,
        mut prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
        held: bool,
        delivered: &mut bool,
    ) -> Result<(), Relay> {
        // A held answer's events wait here until decode is done: until then the client has
        // seen nothing, and a broken stream can be retried whole on another pair.
        let mut holding: Vec<Event> = Vec::new();
        let mut emit = |event: Event| -> bool {
            if held {
                holding.push(event);
                return true;
            }
            *delivered = true;
            tx.send(event).is_ok()
        };
        let mut body = resp.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        let mut last: Option<Instant> = None;
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| Relay::Broke(fail(PeerError, 502, format!("decode stream broke: {e}"))))?;
            buf.extend_from_slice(&chunk);
            while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                let parsed: StreamLine =
                    serde_json::from_slice(&line).map_err(|e| Relay::Failed(fail(PeerError, 502, format!("bad line from decode: {e}"))))?;
                let event = match parsed {
                    StreamLine::Token(_) | StreamLine::Scored { .. } => {
                        let now = Instant::now();
                        match last {
                            None => {
                                self.metrics.ttft.observe((now - arrived).as_secs_f64());
                                tracing::Span::current().record("time_to_first_token", (now - arrived).as_secs_f64());
                            }
                            Some(prev) => self.metrics.inter_token.observe((now - prev).as_secs_f64()),
                        }
                        last = Some(now);
                        self.metrics.generation_tokens.inc();
                        if let Some(prompt) = prompt_logprobs.take() {
                            emit(Event::PromptLogprobs(prompt));
                        }
                        match parsed {
                            StreamLine::Scored { token, logprobs } => Event::Token(token, Some(logprobs)),
                            StreamLine::Token(token) => Event::Token(token, None),
                            _ => unreachable!("matched above"),
                        }
                    }
                    StreamLine::Done { finish, prompt_tokens, completion_tokens } => {
                        self.metrics.duration.observe(arrived.elapsed().as_secs_f64());
                        tracing::Span::current().record("completion_tokens", i64::from(completion_tokens));
                        *delivered = true;
                        for event in holding {
                            let _ = tx.send(event);
                        }
                        let _ = tx.send(Event::Done { finish, prompt_tokens: prompt_tokens as usize, completion_tokens: completion_tokens as usize });
                        return Ok(());
                    }
                    StreamLine::Error { status, code, message } => return Err(Relay::Failed(fail(code, status, message))),
                };
                if !emit(event) {
                    return Ok(()); // client left; dropping the stream tells decode
                }
            }
        }
        Err(Relay::Broke(fail(PeerError, 502, "decode ended the stream without finishing")))
    }
}

/// How relaying decode's stream failed.
/// One request as every attempt at it sees it.
struct Job<'a> {
    tx: &'a UnboundedSender<Event>,
    prompt: Vec<u32>,
    max_tokens: usize,
    sampling: Sampling,
    arrived: Instant,
    request: &'a RequestContext,
}

/// The pair an attempt runs on, counted busy while it does.
struct Pair {
    prefill: Arc<Peer>,
    decode: Arc<Peer>,
    _busy: (super::peers::Busy, super::peers::Busy),
}

/// What prefill left for decode: its prompt log-probabilities, and when prefill failed, how
/// long decode may wait for the transfer's commit and why the request may be tried again if the
/// transfer did fail.
struct Prefilled {
    prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
    commit_wait: Option<Duration>,
    retry_as: Option<Retry>,
}

enum Relay {
    /// The stream broke or ended early (decode died or closed it).
    Broke(Event),
    /// Decode said it failed, or sent what is not a stream line.
    Failed(Event),
}
