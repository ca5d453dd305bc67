//! Every reason decode refuses a handoff for, as one closed set.
//!
//! The `reason` label of `kvgate_handoff_mismatch_total` and `kvgate_kv_port_rejected_total`, the
//! error code the router returns (`kv_handoff_<reason>`, `codes::ErrorCode::KvHandoff`), the reason an ack carries on the wire,
//! the table in `docs/handoff-protocol.md` and the alert rules all come from these enums; tests
//! check the docs and the alerts against `ALL`.

use std::fmt;

/// Why decode refused an *authenticated* transfer: evidence of KV that was missing, corrupt,
/// forged, or sent where it must not go. Each one fires `KvgateHandoffIntegrityViolation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mismatch {
    /// A page, or the whole transfer, carries a different number of tokens than was reserved.
    TokenCount,
    /// A page's bytes do not match its tag, or the commit's digest does not match the pages.
    /// The tag is a keyed MAC (`page_tag`), not a plain checksum; the label says what a reader
    /// of the alert needs: the bytes are not the bytes prefill sealed.
    Checksum,
    /// A page outside the reservation, a page index sent twice, or reserved pages never sent.
    PageSet,
    /// A frame for a live handoff does not carry its MAC: forged or altered on the path.
    Auth,
    /// The sender's model or KV layout is not decode's.
    Fingerprint,
    /// The transfer stopped half way: a dead peer, a stalled connection, or past the deadline.
    Timeout,
    /// An authenticated frame for a handoff decode never reserved or already committed.
    UnknownHandoff,
    /// KV arrived for a prompt prefill had rejected (the incident).
    RejectedForwarded,
    /// The committed first token is outside the model's vocabulary.
    FirstToken,
    /// An authenticated frame that breaks the frame format (a page payload shorter than a page).
    Protocol,
    /// KV sealed for one tenant offered to another tenant's reservation or generation.
    Tenant,
}

impl Mismatch {
    pub const ALL: [Mismatch; 11] = [
        Mismatch::TokenCount,
        Mismatch::Checksum,
        Mismatch::PageSet,
        Mismatch::Auth,
        Mismatch::Fingerprint,
        Mismatch::Timeout,
        Mismatch::UnknownHandoff,
        Mismatch::RejectedForwarded,
        Mismatch::FirstToken,
        Mismatch::Protocol,
        Mismatch::Tenant,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Mismatch::TokenCount => "token_count",
            Mismatch::Checksum => "checksum",
            Mismatch::PageSet => "page_set",
            Mismatch::Auth => "auth",
            Mismatch::Fingerprint => "fingerprint",
            Mismatch::Timeout => "timeout",
            Mismatch::UnknownHandoff => "unknown_handoff",
            Mismatch::RejectedForwarded => "rejected_forwarded",
            Mismatch::FirstToken => "first_token",
            Mismatch::Protocol => "protocol",
            Mismatch::Tenant => "tenant",
        }
    }

    /// What the reason means, for the docs table.
    pub const fn meaning(self) -> &'static str {
        match self {
            Mismatch::TokenCount => "a page, or the whole transfer, carries a different number of tokens than was reserved",
            Mismatch::Checksum => {
                "a page's bytes do not match its tag (altered after prefill sealed it), or the commit's digest does not match the pages received"
            }
            Mismatch::PageSet => "a page outside the reservation, a page index sent twice, or reserved pages that never arrived",
            Mismatch::Auth => "a frame for a live handoff does not carry its MAC (forged or altered on the path)",
            Mismatch::Fingerprint => "the sender's model or KV layout fingerprint is not decode's",
            Mismatch::Timeout => "the transfer stopped half way: the peer died or stalled, or the deadline passed",
            Mismatch::UnknownHandoff => "an authenticated frame for a handoff that was never reserved or is already committed",
            Mismatch::RejectedForwarded => "KV arrived for a prompt prefill had rejected (the incident)",
            Mismatch::FirstToken => "the committed first token is outside the model's vocabulary",
            Mismatch::Protocol => "an authenticated frame that breaks the frame format (a page payload shorter than a page)",
            Mismatch::Tenant => {
                "KV sealed for one tenant offered to another tenant's reservation, or a generation asked for by another tenant than the reservation's"
            }
        }
    }
}

/// Why decode's KV port refused bytes nobody holding the secret sent, or a connection it would
/// not serve: abuse or noise, never an integrity event (`KvgateKVPortAbuse`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortRefusal {
    Malformed,
    TooLarge,
    Unauthenticated,
    ReadTimeout,
    ConnectionLimit,
}

impl PortRefusal {
    pub const ALL: [PortRefusal; 5] =
        [PortRefusal::Malformed, PortRefusal::TooLarge, PortRefusal::Unauthenticated, PortRefusal::ReadTimeout, PortRefusal::ConnectionLimit];

    pub const fn as_str(self) -> &'static str {
        match self {
            PortRefusal::Malformed => "malformed",
            PortRefusal::TooLarge => "too_large",
            PortRefusal::Unauthenticated => "unauthenticated",
            PortRefusal::ReadTimeout => "read_timeout",
            PortRefusal::ConnectionLimit => "connection_limit",
        }
    }

    pub const fn meaning(self) -> &'static str {
        match self {
            PortRefusal::Malformed => "bytes that are not a frame of the protocol (including a page frame declaring a payload larger than a page)",
            PortRefusal::TooLarge => "a frame larger than a page frame can be",
            PortRefusal::Unauthenticated => "a frame for no open handoff whose MAC does not verify",
            PortRefusal::ReadTimeout => "no whole frame within `--kv-frame-timeout-ms` (the first one within `--kv-auth-timeout-ms`)",
            PortRefusal::ConnectionLimit => "an authenticated connection beyond `--kv-max-connections`",
        }
    }
}

/// Any refusal of a handoff: what an ack and the router's error carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    Mismatch(Mismatch),
    Port(PortRefusal),
    /// The router cancelled the reservation before decode was asked to generate from it.
    Cancelled,
}

impl Refusal {
    pub const fn as_str(self) -> &'static str {
        match self {
            Refusal::Mismatch(m) => m.as_str(),
            Refusal::Port(p) => p.as_str(),
            Refusal::Cancelled => "cancelled",
        }
    }

    /// Reads back the reason an ack carried.
    pub fn parse(s: &str) -> Option<Refusal> {
        let m = Mismatch::ALL.into_iter().find(|m| m.as_str() == s).map(Refusal::Mismatch);
        m.or_else(|| PortRefusal::ALL.into_iter().find(|p| p.as_str() == s).map(Refusal::Port)).or((s == "cancelled").then_some(Refusal::Cancelled))
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<Mismatch> for Refusal {
    fn from(m: Mismatch) -> Self {
        Refusal::Mismatch(m)
    }
}

impl From<PortRefusal> for Refusal {
    fn from(p: PortRefusal) -> Self {
        Refusal::Port(p)
    }
}

/// The Markdown table of every reason, as `docs/handoff-protocol.md` carries it (between its
/// `generated:refusal-reasons` markers; `make generate` writes it).
pub fn markdown_table() -> String {
    let mut out = String::from("| reason | counted in | means |\n| --- | --- | --- |\n");
    for m in Mismatch::ALL {
        out += &format!("| `{}` | `kvgate_handoff_mismatch_total` | {} |\n", m.as_str(), m.meaning());
    }
    for p in PortRefusal::ALL {
        out += &format!("| `{}` | `kvgate_kv_port_rejected_total` | {} |\n", p.as_str(), p.meaning());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_is_distinct_and_reads_back() {
        let names: Vec<&str> = Mismatch::ALL.iter().map(|m| m.as_str()).chain(PortRefusal::ALL.iter().map(|p| p.as_str())).chain(["cancelled"]).collect();
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "a reason is spelled twice: {names:?}");
        for n in names {
            assert_eq!(Refusal::parse(n).map(Refusal::as_str), Some(n));
        }
        assert_eq!(Refusal::parse("nonsense"), None);
    }
}
