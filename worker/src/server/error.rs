//! OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use kvgate_proto::codes::ErrorCode;

use crate::engine::Rejection;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: ErrorCode,
    pub param: Option<String>,
    pub message: String,
}

impl ApiError {
    /// A bad request naming the offending field.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code: ErrorCode::InvalidValue,
            param: Some(param.into()),
            message: message.into(),
        }
    }

    /// A body over the limit, which follows the context window (see `server::limits`).
    pub fn body_too_large(limit: usize) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            kind: "invalid_request_error",
            code: ErrorCode::RequestTooLarge,
            param: Some("body".into()),
            message: format!("The request body is larger than this worker's limit of {limit} bytes (the limit follows the context window)."),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, kind: "server_error", code: ErrorCode::InternalError, param: None, message: message.into() }
    }
}

impl From<Rejection> for ApiError {
    fn from(r: Rejection) -> Self {
        let (status, kind, param) = match r {
            Rejection::ContextLength { .. } => (StatusCode::BAD_REQUEST, "invalid_request_error", Some("messages_or_prompt")),
            Rejection::NeverFits { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", Some("prompt")),
            Rejection::PoolBusy { .. } => (StatusCode::SERVICE_UNAVAILABLE, "server_overloaded", None),
            Rejection::EmptyPrompt => (StatusCode::BAD_REQUEST, "invalid_request_error", Some("prompt")),
        };
        ApiError { status, kind, code: r.code(), param: param.map(str::to_string), message: r.to_string() }
    }
}

impl From<&crate::tenants::identify::Unauthenticated> for ApiError {
    fn from(u: &crate::tenants::identify::Unauthenticated) -> Self {
        let (code, message) = u.explain();
        ApiError { status: StatusCode::UNAUTHORIZED, kind: "invalid_request_error", code, param: None, message }
    }
}

impl From<&crate::tenants::quota::OverQuota> for ApiError {
    fn from(q: &crate::tenants::quota::OverQuota) -> Self {
        ApiError { status: StatusCode::TOO_MANY_REQUESTS, kind: "rate_limit_error", code: ErrorCode::TenantTokenQuota, param: None, message: q.message() }
    }
}

impl From<crate::engine::Failure> for ApiError {
    fn from(f: crate::engine::Failure) -> Self {
        ApiError {
            status: StatusCode::from_u16(f.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            kind: "server_error",
            code: f.code,
            param: None,
            message: f.message,
        }
    }
}

/// Seconds a client refused for load (429: over its share in flight; 503: no pages free in
/// time, no peer pair) is told to wait before it tries again: the caps are of work in flight,
/// which frees in about that long.
pub const RETRY_AFTER_SECS: u32 = 1;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": { "message": self.message, "type": self.kind, "param": self.param, "code": self.code }
        });
        let mut response = (self.status, Json(body)).into_response();
        if matches!(self.status, StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE) {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, RETRY_AFTER_SECS.into());
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_for_load_say_when_to_come_back_and_client_errors_do_not() {
        let busy = ApiError { status: StatusCode::TOO_MANY_REQUESTS, ..ApiError::internal("busy") }.into_response();
        assert_eq!(busy.headers()[axum::http::header::RETRY_AFTER], "1");
        let unavailable = ApiError { status: StatusCode::SERVICE_UNAVAILABLE, ..ApiError::internal("no pages") }.into_response();
        assert_eq!(unavailable.headers()[axum::http::header::RETRY_AFTER], "1");
        let invalid = ApiError::invalid("prompt", "empty").into_response();
        assert!(!invalid.headers().contains_key(axum::http::header::RETRY_AFTER));
    }
}
