//! A failed request as the router answers it: with a code of its own (`NoPeers`,
//! `PeerUnreachable`, `PeerError`) or one a peer gave (decode's refusals, prefill's rejections),
//! relayed. Codes are `ErrorCode`s: the router decides on them by matching, never on a string.

use kvgate_proto::codes::ErrorCode;

use crate::engine::{Event, Failure};

/// A failed request with `code`.
pub fn fail(code: ErrorCode, status: u16, message: impl Into<String>) -> Event {
    Event::Failed(Failure { status, code, message: message.into() })
}
