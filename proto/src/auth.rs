//! Keys and MACs of a deployment's internal traffic, all derived from its handoff secret.
//!
//! One secret, four independent keys (BLAKE3 `derive_key`, one context string each), so a
//! value computed for one purpose is never valid for another:
//!
//! - **request key**: MACs of internal HTTP calls (router -> prefill, router -> decode), over
//!   method, path and query, the callee's instance, a timestamp, a nonce, and the body's length
//!   and hash ([`DeploymentKey::sign_request`]). The header alone can be checked, so a callee
//!   reads no byte of a body before it knows the caller holds the secret; naming the callee's
//!   instance (random per process) makes a captured call worthless at any other pod, and at
//!   the same pod after a restart;
//! - **reservation key**: the tag decode mints over a reservation, which prefill checks before it
//!   dials the KV address the reservation names ([`DeploymentKey::reservation_tag`]);
//! - **frame key**: the parent of one key per handoff id and tenant ([`DeploymentKey::frame_key`]) with which
//!   every page and commit frame is MACed (keyed BLAKE3 over header and body; a page's payload
//!   enters through its tag, a Carter-Wegman MAC under keys derived from the same frame key,
//!   [`crate::page_tag`]);
//! - **report key**: a worker's MAC over its capacity report, the nonce the operator sent and the
//!   pod's own name ([`DeploymentKey::report_mac`]), so the operator verifies a pod only on a
//!   report that pod's worker made just now.
//!
//! Whoever lacks the secret can neither call an internal endpoint, nor have prefill send KV
//! anywhere, nor write or alter a page of a transfer, even when it sees every byte on the wire.

use std::fmt;

use crate::handoff_id::HandoffId;
use crate::page_tag::PageTagKey;
use crate::tenant_tag::TenantTag;

/// Length of every key, tag and MAC here (BLAKE3's output).
pub const MAC_LEN: usize = 32;
/// Shortest secret accepted.
pub const MIN_SECRET_LEN: usize = 16;
/// Header carrying an internal request's signature.
pub const SIGNATURE_HEADER: &str = "x-kvgate-signature";

const REQUEST_CONTEXT: &str = "kvgate 2026-11 internal request v1";
const RESERVATION_CONTEXT: &str = "kvgate 2026-11 reservation tag v1";
const FRAME_CONTEXT: &str = "kvgate 2026-12 handoff frame v3";
const REPORT_CONTEXT: &str = "kvgate 2026-12 capacity report v1";
/// Header carrying the MAC of a capacity report asked for with a nonce.
pub const REPORT_MAC_HEADER: &str = "x-kvgate-report-mac";

/// A MAC, tag or key: compared in constant time, never printed in full.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Mac(pub [u8; MAC_LEN]);

impl Mac {
    /// Equality whose time does not depend on where the inputs differ.
    pub fn verify(&self, other: &Mac) -> bool {
        blake3::Hash::from(self.0) == blake3::Hash::from(other.0)
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(s: &str) -> Result<Mac, AuthError> {
        if s.len() != MAC_LEN * 2 || !s.is_ascii() {
            return Err(AuthError::Malformed(format!("a MAC is {} hex digits, got {} characters", MAC_LEN * 2, s.len())));
        }
        let mut out = [0u8; MAC_LEN];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| AuthError::Malformed("a MAC must be hex".into()))?;
        }
        Ok(Mac(out))
    }
}

/// In JSON as its hex digits.
impl serde::Serialize for Mac {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> serde::Deserialize<'de> for Mac {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Mac::from_hex(&s).map_err(serde::de::Error::custom)
    }
}

impl fmt::Debug for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Mac({:02x}{:02x}..)", self.0[0], self.0[1])
    }
}

/// Why an internal request's signature was refused; each is one `reason` label of
/// `kvgate_internal_requests_rejected_total`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthError {
    /// No signature header.
    Missing,
    /// The header is not `v1;t=..;n=..;m=..`.
    Malformed(String),
    /// The timestamp is further from this process's clock than the allowed skew.
    Stale { skew_ms: u64, max_ms: u64 },
    /// The nonce was seen before inside the skew window.
    Replayed,
    /// The MAC does not match: the caller does not hold this deployment's secret, or altered
    /// the request.
    BadMac,
    /// The call was signed for another worker process (another pod, or this pod before a
    /// restart): a replay at the wrong place.
    WrongTarget,
    /// The body is not the one the signature names (length or hash).
    BodyMismatch,
}

impl AuthError {
    pub const REASONS: [&'static str; 7] = ["missing", "malformed", "stale", "replayed", "bad_mac", "wrong_target", "body_mismatch"];

    pub fn reason(&self) -> &'static str {
        match self {
            AuthError::Missing => "missing",
            AuthError::Malformed(_) => "malformed",
            AuthError::Stale { .. } => "stale",
            AuthError::Replayed => "replayed",
            AuthError::BadMac => "bad_mac",
            AuthError::WrongTarget => "wrong_target",
            AuthError::BodyMismatch => "body_mismatch",
        }
    }
}

impl fmt::Display for AuthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AuthError::Missing => write!(f, "internal endpoints need the `{SIGNATURE_HEADER}` header of a caller that holds the deployment's handoff secret"),
            AuthError::Malformed(m) => write!(f, "the `{SIGNATURE_HEADER}` header is malformed: {m}"),
            AuthError::Stale { skew_ms, max_ms } => {
                write!(f, "the signature's timestamp is {skew_ms} ms away from this worker's clock (at most {max_ms} ms allowed)")
            }
            AuthError::Replayed => write!(f, "this signature was already used (replayed request)"),
            AuthError::BadMac => write!(f, "the request's signature does not verify with this deployment's handoff secret"),
            AuthError::WrongTarget => write!(f, "this call was signed for another worker process (captured elsewhere, or before this worker restarted)"),
            AuthError::BodyMismatch => write!(f, "the request's body is not the one its signature names (length or BLAKE3 hash differ)"),
        }
    }
}

impl std::error::Error for AuthError {}

/// A worker process, as the target of signed calls: random at every start, published in its
/// capacity report (`instance`), so a signature is good at one process only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Instance(pub u128);

impl Instance {
    pub fn random() -> Instance {
        Instance(rand::random())
    }
}

impl fmt::Display for Instance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl std::str::FromStr for Instance {
    type Err = AuthError;
    fn from_str(s: &str) -> Result<Self, AuthError> {
        if s.len() != 32 {
            return Err(AuthError::Malformed("an instance is 32 hex digits".into()));
        }
        u128::from_str_radix(s, 16).map(Instance).map_err(|_| AuthError::Malformed("an instance must be hex".into()))
    }
}

/// A parsed `x-kvgate-signature` value:
/// `v2;t=MS;n=NONCE;to=INSTANCE;len=BYTES;h=BODY_HASH;m=MAC`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signature {
    pub timestamp_ms: u64,
    pub nonce: u128,
    /// The callee.
    pub target: Instance,
    /// The body's length and BLAKE3 hash: a callee stops reading at `body_len` and checks the
    /// hash as the bytes arrive.
    pub body_len: u64,
    pub body_hash: Mac,
    pub mac: Mac,
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "v2;t={};n={:032x};to={};len={};h={};m={}",
            self.timestamp_ms,
            self.nonce,
            self.target,
            self.body_len,
            self.body_hash.to_hex(),
            self.mac.to_hex()
        )
    }
}

impl std::str::FromStr for Signature {
    type Err = AuthError;
    fn from_str(s: &str) -> Result<Self, AuthError> {
        let bad = |m: &str| AuthError::Malformed(m.to_string());
        let mut parts = s.split(';');
        if parts.next() != Some("v2") {
            return Err(bad("it must start with `v2;`"));
        }
        let mut field = |name: &str| {
            parts
                .next()
                .and_then(|p| p.strip_prefix(name))
                .and_then(|p| p.strip_prefix('='))
                .ok_or_else(|| bad(&format!("field `{name}` missing or out of order")))
        };
        let timestamp_ms = field("t")?.parse().map_err(|_| bad("`t` must be milliseconds since the Unix epoch"))?;
        let nonce_hex = field("n")?;
        if nonce_hex.len() != 32 {
            return Err(bad("`n` must be 32 hex digits"));
        }
        let nonce = u128::from_str_radix(nonce_hex, 16).map_err(|_| bad("`n` must be hex"))?;
        let target = field("to")?.parse()?;
        let body_len = field("len")?.parse().map_err(|_| bad("`len` must be the body's length in bytes"))?;
        let body_hash = Mac::from_hex(field("h")?)?;
        let mac = Mac::from_hex(field("m")?)?;
        if parts.next().is_some() {
            return Err(bad("trailing fields"));
        }
        Ok(Signature { timestamp_ms, nonce, target, body_len, body_hash, mac })
    }
}

/// A body's BLAKE3 hash, fed as its chunks arrive.
#[derive(Default)]
pub struct BodyHasher(blake3::Hasher);

impl BodyHasher {
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    pub fn finish(&self) -> Mac {
        Mac(*self.0.finalize().as_bytes())
    }
}

/// The hash a signature names for `body`.
pub fn body_hash(body: &[u8]) -> Mac {
    Mac(*blake3::hash(body).as_bytes())
}

/// What a reservation tag covers: everything prefill acts on.
#[derive(Debug, Clone, Copy)]
pub struct ReservationFields<'a> {
    pub handoff: HandoffId,
    pub reserved_tokens: u32,
    pub max_tokens: u32,
    pub expires_ms: u64,
    pub pages: &'a [u32],
    pub kv_addr: &'a str,
    /// The tenant whose request the reservation holds room for.
    pub tenant: TenantTag,
}

/// The keys of one deployment, derived from its handoff secret.
#[derive(Clone)]
pub struct DeploymentKey {
    request: [u8; MAC_LEN],
    reservation: [u8; MAC_LEN],
    frame: [u8; MAC_LEN],
    report: [u8; MAC_LEN],
}

impl fmt::Debug for DeploymentKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DeploymentKey(<redacted>)")
    }
}

/// The key that MACs the frames of one handoff, with the keys of its page tags derived from it.
#[derive(Clone)]
pub struct FrameKey {
    mac: [u8; MAC_LEN],
    tags: PageTagKey,
}

impl fmt::Debug for FrameKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FrameKey(<redacted>)")
    }
}

impl FrameKey {
    /// A MAC over `parts` in order (a frame's header, then its body without the MAC).
    pub fn mac(&self, parts: &[&[u8]]) -> Mac {
        let mut m = blake3::Hasher::new_keyed(&self.mac);
        for p in parts {
            m.update(p);
        }
        Mac(*m.finalize().as_bytes())
    }

    /// The keys of this handoff's page tags ([`crate::page_tag`]).
    pub fn page_tags(&self) -> &PageTagKey {
        &self.tags
    }
}

/// Unix time in milliseconds: what signatures and reservation deadlines are stated in.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Why a secret cannot key a deployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyError {
    TooShort { len: usize },
}

impl std::fmt::Display for KeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyError::TooShort { len } => write!(f, "the handoff secret must be at least {MIN_SECRET_LEN} bytes, got {len}"),
        }
    }
}

impl std::error::Error for KeyError {}

impl DeploymentKey {
    /// Derives the keys from a secret of at least [`MIN_SECRET_LEN`] bytes.
    pub fn new(secret: &[u8]) -> Result<Self, KeyError> {
        if secret.len() < MIN_SECRET_LEN {
            return Err(KeyError::TooShort { len: secret.len() });
        }
        Ok(DeploymentKey {
            request: blake3::derive_key(REQUEST_CONTEXT, secret),
            reservation: blake3::derive_key(RESERVATION_CONTEXT, secret),
            frame: blake3::derive_key(FRAME_CONTEXT, secret),
            report: blake3::derive_key(REPORT_CONTEXT, secret),
        })
    }

    /// The key for the frames of handoff `id` sealed for `tenant`; decode and prefill derive it
    /// independently, so a frame sealed for one tenant never verifies as another's.
    pub fn frame_key(&self, id: HandoffId, tenant: TenantTag) -> FrameKey {
        let mut h = blake3::Hasher::new_keyed(&self.frame);
        h.update(&id.0.to_le_bytes());
        h.update(&tenant.0);
        let mac = *h.finalize().as_bytes();
        FrameKey { mac, tags: PageTagKey::derive(&mac) }
    }

    /// The tag decode mints for a reservation. Prefill recomputes it before dialing `kv_addr`,
    /// so it sends KV only where this deployment's decode said to.
    pub fn reservation_tag(&self, r: &ReservationFields) -> Mac {
        let mut h = blake3::Hasher::new_keyed(&self.reservation);
        h.update(&r.handoff.0.to_le_bytes());
        h.update(&r.reserved_tokens.to_le_bytes());
        h.update(&r.max_tokens.to_le_bytes());
        h.update(&r.expires_ms.to_le_bytes());
        h.update(&(r.pages.len() as u64).to_le_bytes());
        for p in r.pages {
            h.update(&p.to_le_bytes());
        }
        h.update(r.kv_addr.as_bytes());
        h.update(&r.tenant.0);
        Mac(*h.finalize().as_bytes())
    }

    /// The MAC a worker sends with its capacity report: over the operator's `nonce` (a replayed
    /// report fails), the name of the pod it runs in (another pod's report fails) and the
    /// report's exact bytes.
    pub fn report_mac(&self, nonce: u128, pod: &str, body: &[u8]) -> Mac {
        let mut h = blake3::Hasher::new_keyed(&self.report);
        h.update(&nonce.to_le_bytes());
        h.update(&(pod.len() as u64).to_le_bytes());
        h.update(pod.as_bytes());
        h.update(body);
        Mac(*h.finalize().as_bytes())
    }

    /// The MAC over everything a signature names; the body enters by length and hash only, so
    /// the header can be checked before any byte of the body is read.
    fn request_mac(&self, method: &str, path: &str, sig: &Signature) -> Mac {
        let mut h = blake3::Hasher::new_keyed(&self.request);
        for field in [method.as_bytes(), b"\n", path.as_bytes(), b"\n"] {
            h.update(field);
        }
        h.update(&sig.target.0.to_le_bytes());
        h.update(&sig.timestamp_ms.to_le_bytes());
        h.update(&sig.nonce.to_le_bytes());
        h.update(&sig.body_len.to_le_bytes());
        h.update(&sig.body_hash.0);
        Mac(*h.finalize().as_bytes())
    }

    /// Signs one internal request to `target` (`path` with its query string; the caller
    /// supplies a fresh random nonce and its clock).
    pub fn sign_request(&self, method: &str, path: &str, target: Instance, timestamp_ms: u64, nonce: u128, body: &[u8]) -> Signature {
        let mut sig = Signature { timestamp_ms, nonce, target, body_len: body.len() as u64, body_hash: body_hash(body), mac: Mac([0; MAC_LEN]) };
        sig.mac = self.request_mac(method, path, &sig);
        sig
    }

    /// Checks a signature's MAC, its target and its timestamp against `now_ms`, before the body
    /// is read (the body is the caller's to check against `body_len`/`body_hash`; replay is the
    /// caller's nonce cache: only signatures that pass here may enter it).
    pub fn verify_request(&self, sig: &Signature, method: &str, path: &str, me: Instance, now_ms: u64, max_skew_ms: u64) -> Result<(), AuthError> {
        if !self.request_mac(method, path, sig).verify(&sig.mac) {
            return Err(AuthError::BadMac);
        }
        if sig.target != me {
            return Err(AuthError::WrongTarget);
        }
        let skew_ms = now_ms.abs_diff(sig.timestamp_ms);
        if skew_ms > max_skew_ms {
            return Err(AuthError::Stale { skew_ms, max_ms: max_skew_ms });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> DeploymentKey {
        DeploymentKey::new(&[b; 32]).unwrap()
    }

    fn fields(pages: &[u32]) -> ReservationFields<'_> {
        ReservationFields {
            handoff: HandoffId(1),
            reserved_tokens: 100,
            max_tokens: 8,
            expires_ms: 5,
            pages,
            kv_addr: "10.0.0.1:8083",
            tenant: TenantTag::of("acme"),
        }
    }

    #[test]
    fn a_report_mac_binds_nonce_pod_body_and_secret_and_no_other_key_matches() {
        let k = key(1);
        let m = k.report_mac(7, "p-0", b"{}");
        assert!(m.verify(&k.report_mac(7, "p-0", b"{}")));
        for other in [k.report_mac(8, "p-0", b"{}"), k.report_mac(7, "p-1", b"{}"), k.report_mac(7, "p-0", b"{ }"), key(2).report_mac(7, "p-0", b"{}")] {
            assert!(!m.verify(&other));
        }
        // The pod name is length-prefixed: moving bytes between name and body changes the MAC.
        assert!(!k.report_mac(7, "p-0{", b"}").verify(&k.report_mac(7, "p-0", b"{}")));
    }

    #[test]
    fn a_reservation_tag_binds_every_field_and_the_secret() {
        let k = key(1);
        let t = k.reservation_tag(&fields(&[3, 4]));
        assert!(t.verify(&k.reservation_tag(&fields(&[3, 4]))));
        let variants = [
            ReservationFields { handoff: HandoffId(2), ..fields(&[3, 4]) },
            ReservationFields { reserved_tokens: 99, ..fields(&[3, 4]) },
            ReservationFields { max_tokens: 9, ..fields(&[3, 4]) },
            ReservationFields { expires_ms: 6, ..fields(&[3, 4]) },
            ReservationFields { kv_addr: "10.0.0.2:8083", ..fields(&[3, 4]) },
            ReservationFields { tenant: TenantTag::of("globex"), ..fields(&[3, 4]) },
            fields(&[4, 3]),
            fields(&[3, 4, 5]),
        ];
        for v in variants {
            assert!(!t.verify(&k.reservation_tag(&v)), "{v:?}");
        }
        assert!(!t.verify(&key(2).reservation_tag(&fields(&[3, 4]))));
    }

    #[test]
    fn frame_keys_differ_per_handoff_per_tenant_and_per_secret() {
        let k = key(1);
        let acme = TenantTag::of("acme");
        let mac = |k: &DeploymentKey, id, tenant| k.frame_key(HandoffId(id), tenant).mac(&[b"header", b"body"]);
        assert_eq!(mac(&k, 1, acme), mac(&k, 1, acme));
        assert_ne!(mac(&k, 1, acme), mac(&k, 2, acme));
        assert_ne!(mac(&k, 1, acme), mac(&k, 1, TenantTag::of("globex")));
        assert_ne!(mac(&k, 1, acme), mac(&key(2), 1, acme));
        // The split between parts does not matter, the bytes do.
        assert_eq!(k.frame_key(HandoffId(1), acme).mac(&[b"headerbody"]), mac(&k, 1, acme));
    }

    const ME: Instance = Instance(42);

    #[test]
    fn request_signatures_bind_method_path_query_target_body_and_time() {
        let k = key(1);
        let path = "/internal/v1/reserve";
        let sig = k.sign_request("POST", path, ME, 1_000, 7, b"{}");
        assert_eq!(k.verify_request(&sig, "POST", path, ME, 1_500, 30_000), Ok(()));
        assert_eq!((sig.body_len, sig.body_hash), (2, body_hash(b"{}")));
        assert_eq!(k.verify_request(&sig, "POST", "/internal/v1/prefill", ME, 1_500, 30_000), Err(AuthError::BadMac));
        assert_eq!(k.verify_request(&sig, "POST", "/internal/v1/reserve?x=1", ME, 1_500, 30_000), Err(AuthError::BadMac));
        assert_eq!(k.verify_request(&sig, "GET", path, ME, 1_500, 30_000), Err(AuthError::BadMac));
        assert_eq!(k.verify_request(&sig, "POST", path, Instance(43), 1_500, 30_000), Err(AuthError::WrongTarget));
        assert_eq!(key(2).verify_request(&sig, "POST", path, ME, 1_500, 30_000), Err(AuthError::BadMac));
        assert_eq!(k.verify_request(&sig, "POST", path, ME, 41_000, 30_000), Err(AuthError::Stale { skew_ms: 40_000, max_ms: 30_000 }));
        // Every field the header names is under the MAC: an attacker can change none of them.
        for altered in [
            Signature { target: Instance(43), ..sig },
            Signature { body_len: 3, ..sig },
            Signature { body_hash: body_hash(b"{ }"), ..sig },
            Signature { timestamp_ms: 1_001, ..sig },
            Signature { nonce: 8, ..sig },
        ] {
            assert_eq!(k.verify_request(&altered, "POST", path, altered.target, 1_500, 30_000), Err(AuthError::BadMac), "{altered:?}");
        }
    }

    #[test]
    fn signatures_round_trip_through_their_header_and_refuse_garbage() {
        let sig = key(1).sign_request("POST", "/x", ME, 123, u128::MAX - 5, b"");
        assert_eq!(sig.to_string().parse::<Signature>(), Ok(sig));
        let v1 = "v1;t=1;n=00000000000000000000000000000000;m=00";
        for bad in ["", v1, "v2;t=x", "v2;n=1;t=2", &format!("{sig};x=1"), &sig.to_string().replace(";to=", ";to=zz")] {
            assert!(matches!(bad.parse::<Signature>(), Err(AuthError::Malformed(_))), "{bad}");
        }
        let mut h = BodyHasher::default();
        h.update(b"{");
        h.update(b"}");
        assert_eq!(h.finish(), body_hash(b"{}"), "chunks hash as the whole");
    }

    #[test]
    fn secrets_must_be_long_enough_and_keys_are_never_printed() {
        assert_eq!(DeploymentKey::new(b"short").unwrap_err().to_string(), "the handoff secret must be at least 16 bytes, got 5");
        let k = DeploymentKey::new(b"super-secret-value-123").unwrap();
        assert!(!format!("{k:?}").contains("super"));
        assert_eq!(format!("{:?}", k.frame_key(HandoffId(1), TenantTag::default())), "FrameKey(<redacted>)");
    }
}
