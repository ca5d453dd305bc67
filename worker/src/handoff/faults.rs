//! Faults a prefill worker can be told to commit, so tests can prove decode catches each one.
//! Refused unless `--allow-fault-injection` is also given.

use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Send one page, then commit as if the transfer were complete (the incident).
    TruncateTransfer,
    /// Flip a byte of one page after its checksum was computed.
    CorruptPage,
    /// Send one page to a page id outside the reservation, so a reserved page is never written.
    DropPage,
    /// Send one page twice.
    DuplicatePage,
    /// Use an auth tag that is not the reservation's.
    WrongAuth,
    /// Commit with a model fingerprint that is not this worker's.
    WrongFingerprint,
    /// Stop mid-transfer: a dedicated prefill process exits; in `local` the connection drops.
    DieMidTransfer,
    /// Reject a prompt that cannot fit, but still hand off a one-token placeholder for it.
    IgnoreRejection,
}

impl Fault {
    pub const ALL: [(&'static str, Fault); 8] = [
        ("truncate-transfer", Fault::TruncateTransfer),
        ("corrupt-page", Fault::CorruptPage),
        ("drop-page", Fault::DropPage),
        ("duplicate-page", Fault::DuplicatePage),
        ("wrong-auth", Fault::WrongAuth),
        ("wrong-fingerprint", Fault::WrongFingerprint),
        ("die-mid-transfer", Fault::DieMidTransfer),
        ("ignore-rejection", Fault::IgnoreRejection),
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
}
