//! One canary prompt through one prefill x decode pair, as the router sends a request: decode
//! reserves pages, prefill computes the prompt's KV into them, decode generates greedily from the
//! verified handoff. Every call is signed with the deployment's request key.

use std::time::Duration;

use kvgate_proto::auth::{DeploymentKey, Instance, SIGNATURE_HEADER, now_ms};
use kvgate_proto::contract::{DECODE_PORT, PREFILL_PORT};
use kvgate_proto::roles::{self, GenerateRequest, PrefillRequest, Reservation, ReserveRequest, Sampling, StreamLine};

use crate::engines::{Greedy, NoAnswer};

/// A worker pod the canary calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub pod: String,
    pub ip: String,
    /// The worker process the pod's verified capacity report names (kvgate's workers): signed
    /// calls are good at that process only.
    pub instance: Option<Instance>,
}

const GREEDY: Sampling = Sampling { temperature: 0.0, top_p: 1.0, seed: None, logprobs: None, prompt_logprobs: false, ignore_eos: false };
/// Longest a whole canary request may take (a long prompt on a CPU worker takes seconds).
const TIMEOUT: Duration = Duration::from_secs(120);

async fn post(
    http: &reqwest::Client,
    key: &DeploymentKey,
    to: &Endpoint,
    port: u16,
    path: &str,
    body: &impl serde::Serialize,
) -> Result<reqwest::Response, NoAnswer> {
    let bytes = serde_json::to_vec(body).expect("role bodies serialize");
    let ip = &to.ip;
    let target = to.instance.ok_or_else(|| NoAnswer::failed(format!("pod {}: its capacity report names no worker instance to sign for", to.pod)))?;
    let signature = key.sign_request("POST", path, target, now_ms(), rand::random(), &bytes).to_string();
    let url = format!("http://{ip}:{port}{path}");
    http.post(&url)
        .timeout(TIMEOUT)
        .header(SIGNATURE_HEADER, signature)
        .header("content-type", "application/json")
        .body(bytes)
        .send()
        .await
        .map_err(|e| NoAnswer::failed(format!("POST {url}: {e}")))
}

/// The answer's body when it is not a success: `HTTP 502: {...}`.
async fn refused(resp: reqwest::Response, what: &str) -> Result<reqwest::Response, NoAnswer> {
    if resp.status().is_success() {
        return Ok(resp);
    }
    let status = resp.status().as_u16();
    let body = resp.text().await.unwrap_or_default();
    Err(NoAnswer { status: Some(status), message: format!("{what}: HTTP {status}: {}", body.trim()) })
}

/// The tenant the canary's handoffs are reserved for (kept apart from every user's by the
/// workers' tenant binding).
pub const TENANT: &str = "kvgate-canary";

fn tenant() -> kvgate_proto::tenant_id::TenantId {
    kvgate_proto::tenant_id::TenantId::parse(TENANT).expect("the canary's tenant is a tenant id")
}

/// The tokens decode generated for `q`, or why there are none.
pub async fn generate(http: &reqwest::Client, key: &DeploymentKey, prefill: &Endpoint, decode: &Endpoint, q: &Greedy<'_>) -> Result<Vec<u32>, NoAnswer> {
    let (prompt, max_tokens) = (q.prompt, q.max_tokens);
    let sampling = Sampling { ignore_eos: q.ignore_eos, ..GREEDY };
    let reserve = ReserveRequest { prompt_tokens: prompt.len() as u32, max_tokens, tenant: tenant(), traceparent: traceparent() };
    let resp = refused(post(http, key, decode, DECODE_PORT, roles::RESERVE_PATH, &reserve).await?, "decode's reservation").await?;
    let reservation: Reservation = resp.json().await.map_err(|e| NoAnswer::failed(format!("decode's reservation: {e}")))?;
    let id = reservation.handoff_id;
    let request = PrefillRequest { prompt: prompt.to_vec(), tenant: tenant(), reservation, sampling: Some(sampling), traceparent: traceparent() };
    // Prefill's answer carries decode's verdict on the transfer (a mismatch names its reason).
    refused(post(http, key, prefill, PREFILL_PORT, roles::PREFILL_PATH, &request).await?, "prefill").await?;
    let generate = GenerateRequest { prompt: prompt.to_vec(), tenant: tenant(), max_tokens, sampling, commit_wait_ms: None, traceparent: traceparent() };
    let resp = refused(post(http, key, decode, DECODE_PORT, &roles::generate_path(id), &generate).await?, "decode's generation").await?;
    let text = resp.text().await.map_err(|e| NoAnswer::failed(format!("decode's token stream: {e}")))?;
    let mut tokens = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        match serde_json::from_str::<StreamLine>(line).map_err(|e| NoAnswer::failed(format!("decode's token stream: {e}: {line}")))? {
            StreamLine::Token(t) | StreamLine::Scored { token: t, .. } => tokens.push(t),
            StreamLine::Done { .. } => return Ok(tokens),
            StreamLine::Error { status, code, message } => {
                return Err(NoAnswer { status: Some(status), message: format!("decode's generation: HTTP {status} {code}: {message}") });
            }
        }
    }
    Err(NoAnswer::failed("decode's token stream ended without finishing"))
}

/// The canary run's trace position, when the operator exports spans: the pair's spans join it.
fn traceparent() -> Option<String> {
    kvgate_telemetry::trace_context::current().map(|t| t.to_string())
}
