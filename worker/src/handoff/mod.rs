//! The KV handoff between prefill and decode: reservations and their checks (decode), the KV
//! port that receives frames (decode), the sender (prefill), auth tags and, in `testing` builds
//! only, fault injection.

pub mod auth;
#[cfg(feature = "testing")]
pub mod faults;
#[cfg(feature = "testing")]
pub mod faulty;
pub mod metrics;
pub mod receiver;
pub mod reservations;
#[cfg(feature = "testing")]
pub mod restart_fault;
pub mod sender;
pub mod verify;

pub use auth::Secret;
pub use metrics::HandoffMetrics;
pub use reservations::{HandoffRefusal, Reservations};
