//! One module per `kvgate-worker` subcommand; `roles` starts the pieces they share.

pub mod check;
pub mod local;
pub mod probe;
pub mod roles;

pub use local::shutdown_signal;
