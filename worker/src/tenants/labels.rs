//! Bounded `tenant` label values: the first [`MAX_NAMED`] tenants named get a label of their own
//! (those with API keys first, when told), every later one is counted as [`OTHER`], so a client
//! that makes up tenants cannot grow a metric family without bound.

use std::collections::HashSet;
use std::sync::Mutex;

/// Tenants with a label of their own.
pub const MAX_NAMED: usize = 16;
pub const OTHER: &str = "other";

#[derive(Debug, Default)]
pub struct TenantLabels {
    named: Mutex<HashSet<String>>,
}

impl TenantLabels {
    /// The label `tenant` is counted under.
    pub fn label(&self, tenant: &str) -> String {
        let mut named = self.named.lock().unwrap_or_else(|p| p.into_inner());
        if named.contains(tenant) {
            return tenant.to_string();
        }
        if named.len() < MAX_NAMED {
            named.insert(tenant.to_string());
            return tenant.to_string();
        }
        OTHER.to_string()
    }

    pub fn len(&self) -> usize {
        self.named.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_tenants_are_named_the_rest_other() {
        let l = TenantLabels::default();
        for i in 0..MAX_NAMED {
            assert_eq!(l.label(&format!("t{i}")), format!("t{i}"));
        }
        assert_eq!(l.label("late"), OTHER);
        assert_eq!(l.label("t3"), "t3", "a named tenant keeps its label");
        assert_eq!(l.len(), MAX_NAMED);
    }
}
