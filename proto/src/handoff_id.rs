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

/// On the wire (JSON bodies, paths) as its 32 hex digits; anything else is refused where it is
/// read, never taken for some id.
impl serde::Serialize for HandoffId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for HandoffId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl std::str::FromStr for HandoffId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 32 {
            return Err(format!("handoff id must be 32 hex digits, got {} characters", s.len()));
        }
        if !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err("handoff id must be 32 hex digits, got a character that is not one".into());
        }
        u128::from_str_radix(s, 16).map(HandoffId).map_err(|e| format!("handoff id: {e}"))
    }
}
