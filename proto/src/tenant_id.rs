//! The tenant a request belongs to as the roles tell one another: a tenant's name, a client's
//! address where nobody is authenticated, or `unknown`. One type on every internal call and in
//! every reservation, checked when read, so a malformed tenant never reaches a reservation, a
//! tag or a metric label.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::tenant_tag::TenantTag;

/// Longest tenant as the wire carries it: a 63-character name or an IPv6 address.
pub const MAX_LEN: usize = 63;

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(Arc<str>);

impl TenantId {
    /// `s` as a tenant: 1 to 63 characters of letters, digits, `-`, `_`, `.` and `:` (the
    /// characters of a tenant's name and of an IP address).
    pub fn parse(s: &str) -> Result<TenantId, String> {
        if s.is_empty() || s.len() > MAX_LEN {
            return Err(format!("`tenant` is 1 to {MAX_LEN} characters, got {}", s.len()));
        }
        if let Some(c) = s.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))) {
            return Err(format!("`tenant` has letters, digits, `-`, `_`, `.` and `:` only, not {c:?}"));
        }
        Ok(TenantId(s.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The tag the handoff's frames carry for this tenant.
    pub fn tag(&self) -> TenantTag {
        TenantTag::of(&self.0)
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for TenantId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for TenantId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        TenantId::parse(&String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_addresses_are_tenants_and_nothing_else_is() {
        for t in ["acme", "team-a.prod_1", "10.0.0.7", "fd00::1:2", "unknown"] {
            let id = TenantId::parse(t).unwrap();
            assert_eq!(serde_json::from_str::<TenantId>(&serde_json::to_string(&id).unwrap()).unwrap(), id);
            assert_eq!(id.tag(), TenantTag::of(t));
        }
        assert!(TenantId::parse("").is_err());
        assert!(TenantId::parse(&"a".repeat(MAX_LEN + 1)).is_err());
        let e = serde_json::from_str::<TenantId>(r#""a b""#).unwrap_err().to_string();
        assert!(e.contains("`tenant` has letters") && e.contains("' '"), "{e}");
    }
}
