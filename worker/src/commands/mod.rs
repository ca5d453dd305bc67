//! One module per `kvgate-worker` subcommand.

pub mod local;
pub mod probe;
