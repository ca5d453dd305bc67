//! `GET /v1/kv-pool`: a worker's measured pool; a router's, its peers'.
//!
//! Asked with `?nonce=<32 hex digits>` (the operator asks so), a prefill or decode worker signs
//! the answer: `x-kvgate-report-mac` carries a MAC with the deployment's report key over the
//! nonce, the name of the pod it runs in and the body's exact bytes
//! (`kvgate_proto::auth::DeploymentKey::report_mac`). Only this pod's worker, holding the
//! deployment's secret, could have made that answer to that question.

use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvgate_proto::auth::REPORT_MAC_HEADER;
use kvgate_proto::codes::ErrorCode;
use serde::Deserialize;

use super::error::ApiError;
use super::{AppState, Backend};
use crate::handoff::auth::Secret;

/// What signs this worker's reports: the deployment's secret and the pod's own name.
#[derive(Clone, Debug)]
pub struct ReportSigner {
    pub secret: Secret,
    pub pod: String,
}

#[derive(Debug, Deserialize)]
pub struct ReportQuery {
    nonce: Option<String>,
}

fn bad(code: ErrorCode, message: String) -> Response {
    ApiError { status: StatusCode::BAD_REQUEST, kind: "invalid_request_error", code, param: Some("nonce".into()), message }.into_response()
}

/// A 128-bit nonce as 32 hex digits.
fn parse_nonce(s: &str) -> Option<u128> {
    (s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit())).then(|| u128::from_str_radix(s, 16).ok()).flatten()
}

pub async fn kv_pool(State(state): State<AppState>, query: Result<Query<ReportQuery>, axum::extract::rejection::QueryRejection>) -> Response {
    let nonce = match query {
        Ok(Query(q)) => q.nonce,
        Err(e) => return bad(ErrorCode::InvalidQuery, format!("the query string of GET {}: {e}", kvgate_proto::KV_POOL_PATH)),
    };
    let report = match (&state.report, &state.backend) {
        (Some(r), _) => r,
        (None, Backend::Remote(remote)) if nonce.is_none() => return Json(remote.reports()).into_response(),
        _ => {
            return ApiError {
                status: StatusCode::NOT_FOUND,
                kind: "invalid_request_error",
                code: ErrorCode::NoKvPool,
                param: None,
                message: "this role holds no KV pool of its own to sign; ask a prefill or decode worker".into(),
            }
            .into_response();
        }
    };
    let body = serde_json::to_vec(&**report).expect("a capacity report serializes");
    let mac = match nonce {
        None => None,
        Some(nonce) => {
            let Some(n) = parse_nonce(&nonce) else {
                return bad(ErrorCode::InvalidNonce, format!("nonce must be 32 hex digits (128 bits), got {} characters", nonce.len()));
            };
            let Some(signer) = &state.report_signer else {
                return bad(ErrorCode::CannotSign, "this worker holds no deployment secret (a `local` process), so it cannot sign its report".into());
            };
            Some(signer.secret.key().report_mac(n, &signer.pod, &body))
        }
    };
    let mut response = ([(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response();
    if let Some(mac) = mac {
        response.headers_mut().insert(REPORT_MAC_HEADER, mac.to_hex().parse().expect("hex is a valid header value"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::parse_nonce;

    #[test]
    fn a_nonce_is_exactly_32_hex_digits() {
        assert_eq!(parse_nonce("0000000000000000000000000000002a"), Some(42));
        assert_eq!(parse_nonce(&"f".repeat(32)), Some(u128::MAX));
        for bad in ["2a", &"0".repeat(33), &format!("{}g", "0".repeat(31)), &format!("+{}", "0".repeat(31))] {
            assert_eq!(parse_nonce(bad), None, "{bad}");
        }
    }
}
