//! A tenant as the handoff names it: 16 bytes derived from the tenant's name. Every page and
//! commit frame carries its tenant's tag, every handoff's frame key is derived from it (so a
//! frame sealed for one tenant never verifies as another's), and decode compares it with the
//! reservation's before a byte of the page is written. Not a secret: tenant names are not.

use std::fmt;

pub const TENANT_TAG_LEN: usize = 16;

const CONTEXT: &str = "kvgate 2026-12 tenant tag v1";

#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TenantTag(pub [u8; TENANT_TAG_LEN]);

impl TenantTag {
    pub fn of(tenant: &str) -> TenantTag {
        let h = blake3::derive_key(CONTEXT, tenant.as_bytes());
        TenantTag(h[..TENANT_TAG_LEN].try_into().expect("16 of 32 bytes"))
    }
}

impl fmt::Display for TenantTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for TenantTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TenantTag({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_differ_per_tenant_and_are_stable() {
        assert_eq!(TenantTag::of("acme"), TenantTag::of("acme"));
        assert_ne!(TenantTag::of("acme"), TenantTag::of("globex"));
        assert_eq!(TenantTag::of("acme").to_string().len(), 32);
    }
}
