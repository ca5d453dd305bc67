//! Per-reservation auth tags: HMAC-SHA256 with the deployment's handoff secret over everything
//! that identifies the reservation. Only a holder of the secret can mint a tag, and a tag is
//! valid for exactly one reservation.

use hmac::{Hmac, Mac};
use kvgate_proto::handoff::{HandoffId, TAG_LEN};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// The shared secret. Never printed.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Secret {
    pub fn new(bytes: Vec<u8>) -> Result<Self, String> {
        if bytes.len() < 16 {
            return Err(format!("the handoff secret must be at least 16 bytes, got {}", bytes.len()));
        }
        Ok(Secret(bytes))
    }

    /// A fresh random secret, for a process that runs every role itself.
    pub fn random() -> Self {
        Secret((0..32).map(|_| rand::random::<u8>()).collect())
    }

    pub fn from_file(path: &std::path::Path) -> Result<Self, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("reading --handoff-secret-file {}: {e}", path.display()))?;
        // Trailing newlines from `echo > file` are not part of the secret.
        let trimmed = bytes.trim_ascii_end().to_vec();
        Secret::new(trimmed).map_err(|e| format!("--handoff-secret-file {}: {e}", path.display()))
    }

    /// The reservation's tag. Decode keeps it and compares each frame's tag with it in constant
    /// time, so the HMAC is computed once per reservation, not once per page.
    pub fn tag(&self, id: HandoffId, reserved_tokens: u32, expires_ms: u64, pages: &[u32]) -> [u8; TAG_LEN] {
        let mut mac = HmacSha256::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(b"kvgate-handoff-v1");
        mac.update(&id.0.to_le_bytes());
        mac.update(&reserved_tokens.to_le_bytes());
        mac.update(&expires_ms.to_le_bytes());
        for p in pages {
            mac.update(&p.to_le_bytes());
        }
        mac.finalize().into_bytes().into()
    }
}

pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn tag_from_hex(s: &str) -> Result<[u8; TAG_LEN], String> {
    if s.len() != TAG_LEN * 2 || !s.is_ascii() {
        return Err(format!("auth tag must be {} hex digits", TAG_LEN * 2));
    }
    let mut out = [0u8; TAG_LEN];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| "auth tag is not hex".to_string())?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_binds_every_field_of_its_reservation() {
        let s = Secret::new(vec![1; 32]).unwrap();
        let t = s.tag(HandoffId(1), 100, 5, &[3, 4]);
        assert_eq!(s.tag(HandoffId(1), 100, 5, &[3, 4]), t);
        assert_ne!(s.tag(HandoffId(2), 100, 5, &[3, 4]), t);
        assert_ne!(s.tag(HandoffId(1), 99, 5, &[3, 4]), t);
        assert_ne!(s.tag(HandoffId(1), 100, 6, &[3, 4]), t);
        assert_ne!(s.tag(HandoffId(1), 100, 5, &[4, 3]), t);
        let other = Secret::new(vec![2; 32]).unwrap();
        assert_ne!(other.tag(HandoffId(1), 100, 5, &[3, 4]), t);
    }

    #[test]
    fn secrets_are_never_printed_and_must_be_long_enough() {
        let s = Secret::new(b"super-secret-value-123".to_vec()).unwrap();
        assert!(!format!("{s:?}").contains("super"));
        assert!(Secret::new(b"short".to_vec()).unwrap_err().contains("16 bytes"));
    }

    #[test]
    fn tags_round_trip_through_hex() {
        let t = [0xab; TAG_LEN];
        assert_eq!(tag_from_hex(&to_hex(&t)), Ok(t));
        assert!(tag_from_hex("zz").is_err());
    }
}
