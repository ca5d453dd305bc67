//! The error codes the router gives a request its peers failed, beside the codes it relays from
//! them (decode's refusals, prefill's rejections). One spelling each: the router decides on
//! these, never on a string it compares.

use crate::engine::{Event, Failure};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterCode {
    /// No prefill/decode pair is ready.
    NoPeers,
    /// Decode could not be reached at all (nothing was sent; another pair may serve it).
    PeerUnreachable,
    /// A peer answered something the router cannot use: a bad body, a broken stream.
    PeerError,
}

impl RouterCode {
    pub const fn as_str(self) -> &'static str {
        match self {
            RouterCode::NoPeers => "no_peers",
            RouterCode::PeerUnreachable => "peer_unreachable",
            RouterCode::PeerError => "peer_error",
        }
    }

    /// A failed request with this code.
    pub fn fail(self, status: u16, message: impl Into<String>) -> Event {
        relayed(status, self.as_str().into(), message)
    }

    /// Whether `f` is this code's failure.
    pub fn is(self, f: &Failure) -> bool {
        f.code == self.as_str()
    }
}

/// A failure with a code a peer gave.
pub fn relayed(status: u16, code: String, message: impl Into<String>) -> Event {
    Event::Failed(Failure { status, code, message: message.into() })
}
