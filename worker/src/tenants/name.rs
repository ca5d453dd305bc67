//! A tenant's name: what its API key file is called, what a trusted gateway's header says, and
//! what metrics, spans and refusals name. The characters a Secret's data keys allow, short enough
//! for a metric label.

use std::fmt;
use std::sync::Arc;

/// Longest tenant name.
pub const MAX_LEN: usize = 63;

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantName(Arc<str>);

impl TenantName {
    pub fn parse(s: &str) -> Result<TenantName, String> {
        if s.is_empty() || s.len() > MAX_LEN {
            return Err(format!("a tenant name is 1 to {MAX_LEN} characters, got {}", s.len()));
        }
        if let Some(c) = s.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))) {
            return Err(format!("a tenant name has letters, digits, `-`, `_` and `.` only, not {c:?}"));
        }
        Ok(TenantName(s.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TenantName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_label_safe() {
        assert_eq!(TenantName::parse("team-a.prod_1").unwrap().as_str(), "team-a.prod_1");
        assert!(TenantName::parse("").is_err());
        assert!(TenantName::parse(&"a".repeat(MAX_LEN + 1)).is_err());
        assert_eq!(TenantName::parse("a b").unwrap_err(), "a tenant name has letters, digits, `-`, `_` and `.` only, not ' '");
    }
}
