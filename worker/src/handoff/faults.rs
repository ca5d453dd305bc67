//! Faults a prefill worker can be told to commit, so tests can prove decode (or the operator's
//! canary) catches each one. Only a `testing` build has them, and it takes them from the
//! environment (no flag names them): `KVGATE_INJECT_FAULT=<fault>` with
//! `KVGATE_ALLOW_FAULT_INJECTION=true`, and optionally `KVGATE_FAULT_EVERY` and
//! `KVGATE_FAULT_AFTER`. Test images set them in their configuration.

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

/// The fault to commit, from `KVGATE_INJECT_FAULT`.
pub const INJECT: &str = "KVGATE_INJECT_FAULT";
/// Must be `true` beside any fault, so none is switched on by accident.
pub const ALLOW: &str = "KVGATE_ALLOW_FAULT_INJECTION";
/// Commit the fault on every Nth handoff only (default 1: every one), so tests can check that
/// the handoffs in between stay exact.
pub const EVERY: &str = "KVGATE_FAULT_EVERY";
/// The first N handoffs are clean (default 0): a worker that goes bad under traffic, after any
/// canary.
pub const AFTER: &str = "KVGATE_FAULT_AFTER";

/// A fault and which handoffs get it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Injection {
    pub fault: Fault,
    pub every: u64,
    pub after: u64,
}

impl Injection {
    /// The injection the process's environment asks for; `None`: none.
    pub fn from_env() -> anyhow::Result<Option<Injection>> {
        Injection::from_vars(|name| std::env::var(name).ok())
    }

    /// The same from any lookup of variables.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> anyhow::Result<Option<Injection>> {
        let Some(name) = var(INJECT) else { return Ok(None) };
        anyhow::ensure!(var(ALLOW).as_deref() == Some("true"), "{INJECT}={name} needs {ALLOW}=true, so a fault is never switched on by accident");
        let fault = name.parse().map_err(|e: String| anyhow::anyhow!("{INJECT}: {e}"))?;
        let number = |key: &str, default: u64, least: u64| -> anyhow::Result<u64> {
            match var(key) {
                None => Ok(default),
                Some(v) => match v.parse::<u64>() {
                    Ok(n) if n >= least => Ok(n),
                    _ => anyhow::bail!("{key}={v}: a whole number of handoffs, at least {least}"),
                },
            }
        };
        Ok(Some(Injection { fault, every: number(EVERY, 1, 1)?, after: number(AFTER, 0, 0)? }))
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
    fn an_injection_comes_from_the_environment_only_with_its_safety_variable() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
        assert_eq!(Injection::from_vars(vars(&[])).unwrap(), None);
        let unsafe_ask = Injection::from_vars(vars(&[(INJECT, "corrupt-page")])).unwrap_err().to_string();
        assert!(unsafe_ask.contains("KVGATE_ALLOW_FAULT_INJECTION=true"), "{unsafe_ask}");
        let ok = Injection::from_vars(vars(&[(INJECT, "corrupt-page"), (ALLOW, "true"), (EVERY, "2"), (AFTER, "100")])).unwrap();
        assert_eq!(ok, Some(Injection { fault: Fault::CorruptPage, every: 2, after: 100 }));
        let defaults = Injection::from_vars(vars(&[(INJECT, "wrong-layout"), (ALLOW, "true")])).unwrap().unwrap();
        assert_eq!((defaults.every, defaults.after), (1, 0));
        let unknown = Injection::from_vars(vars(&[(INJECT, "nope"), (ALLOW, "true")])).unwrap_err().to_string();
        assert!(unknown.contains("unknown fault `nope`") && unknown.contains("truncate-transfer"), "{unknown}");
        let zero = Injection::from_vars(vars(&[(INJECT, "corrupt-page"), (ALLOW, "true"), (EVERY, "0")])).unwrap_err().to_string();
        assert!(zero.contains("KVGATE_FAULT_EVERY=0") && zero.contains("at least 1"), "{zero}");
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
