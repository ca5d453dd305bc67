//! The id of one handoff, named on the wire by the reservation, every frame and their MACs.

use std::fmt;

/// A handoff id: random, 128 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HandoffId(pub u128);

impl fmt::Display for HandoffId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl std::str::FromStr for HandoffId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 32 {
            return Err(format!("handoff id must be 32 hex digits, got {} characters", s.len()));
        }
        u128::from_str_radix(s, 16).map(HandoffId).map_err(|e| format!("handoff id: {e}"))
    }
}
