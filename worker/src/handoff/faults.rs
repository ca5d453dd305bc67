//! Faults a prefill worker can be told to commit, so tests can prove decode (or the operator's
//! canary) catches each one.
//! Refused unless `--allow-fault-injection` is also given.

use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Send one page, then commit as if the transfer were complete (the incident).
    TruncateTransfer,
    /// Flip a byte of one page after its tag was computed.
    CorruptPage,
    /// Send one page to a page id outside the reservation, so a reserved page is never written.
    DropPage,
    /// Send one page twice.
    DuplicatePage,
    /// Use an auth tag that is not the reservation's.
    WrongAuth,
    /// Commit with a model fingerprint that is not this worker's.
    WrongFingerprint,
    /// Seal every frame for another tenant than the reservation's (KV computed for another
    /// tenant's request, handed to this one's reservation).
    WrongTenant,
    /// Stop mid-transfer: a dedicated prefill process exits; in `local` the connection drops.
    DieMidTransfer,
    /// Reject a prompt that cannot fit, but still hand off a one-token placeholder for it.
    /// Prompts that fit are served as without the fault (as in the incident, where only
    /// rejected prompts went wrong).
    IgnoreRejection,
    /// Send KV in a layout that is not the one reported (each page's two halves swapped, as K
    /// and V mixed up would be): every tag, MAC and fingerprint holds, the KV is wrong.
    /// Only comparing outputs (the operator's canary) catches it.
    WrongLayout,
    /// Stop at the middle page until the reservation has expired, then go on: a sender starved
    /// of CPU or a path that hung (decode refuses the late frame as `timeout`).
    StallMidTransfer,
}

impl Fault {
    pub const ALL: [(&'static str, Fault); 11] = [
        ("truncate-transfer", Fault::TruncateTransfer),
        ("corrupt-page", Fault::CorruptPage),
        ("drop-page", Fault::DropPage),
        ("duplicate-page", Fault::DuplicatePage),
        ("wrong-auth", Fault::WrongAuth),
        ("wrong-fingerprint", Fault::WrongFingerprint),
        ("wrong-tenant", Fault::WrongTenant),
        ("die-mid-transfer", Fault::DieMidTransfer),
        ("ignore-rejection", Fault::IgnoreRejection),
        ("wrong-layout", Fault::WrongLayout),
        ("stall-mid-transfer", Fault::StallMidTransfer),
    ];
}

impl FromStr for Fault {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Fault::ALL.iter().find(|(name, _)| *name == s).map(|(_, f)| *f).ok_or_else(|| {
            let names: Vec<&str> = Fault::ALL.iter().map(|(n, _)| *n).collect();
            format!("unknown fault `{s}` (known: {})", names.join(", "))
        })
    }
}

/// Whether handoff number `n` (counted from 1) gets the fault: none of the first `after`, then
/// every `every`th.
pub fn hits(n: u64, after: u64, every: u64) -> bool {
    n > after && (n - after).is_multiple_of(every.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fault_parses_from_its_name() {
        for (name, f) in Fault::ALL {
            assert_eq!(name.parse::<Fault>(), Ok(f));
        }
        assert!("melt-gpu".parse::<Fault>().unwrap_err().contains("truncate-transfer"));
    }

    #[test]
    fn a_fault_after_n_spares_the_first_n_handoffs() {
        let hit: Vec<u64> = (1..=8).filter(|&n| hits(n, 3, 1)).collect();
        assert_eq!(hit, [4, 5, 6, 7, 8]);
        let hit: Vec<u64> = (1..=8).filter(|&n| hits(n, 2, 3)).collect();
        assert_eq!(hit, [5, 8]);
        assert_eq!((1..=4).filter(|&n| hits(n, 0, 1)).count(), 4);
    }
}
