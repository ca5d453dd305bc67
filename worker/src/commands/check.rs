//! `--check-config`: validate a command line as the role would on start, then exit without
//! binding, loading or allocating anything. The operator's contract test runs every argument
//! list it renders through this, so a spec the API server accepts always gives pods that start.

use anyhow::Context;

use crate::cli::{Command, SecretArgs};

/// The checks a role makes on its arguments before it starts (clap has already checked each
/// value against its bounds).
pub fn run(command: &Command) -> anyhow::Result<()> {
    match command {
        Command::Local(args) => {
            tenants(&args.tenants)?;
            super::roles::fault_check()
        }
        Command::Router(args) => {
            tenants(&args.tenants)?;
            needs_secret(&args.secret, "router")
        }
        Command::Prefill(args) => {
            super::roles::fault_check()?;
            needs_secret(&args.secret, "prefill")
        }
        Command::Decode(args) => needs_secret(&args.handoff.secret, "decode"),
        Command::Probe(_) => Ok(()),
    }
}

/// The tenant flags parse (the key directory is read on start: a pod mounts it).
fn tenants(args: &crate::cli::TenantArgs) -> anyhow::Result<()> {
    crate::tenants::Settings::parse(args).map(|_| ()).map_err(anyhow::Error::msg)
}

/// The secret file is named (it is read on start; a pod mounts it from a Secret).
fn needs_secret(args: &SecretArgs, role: &str) -> anyhow::Result<()> {
    args.handoff_secret_file.as_ref().map(|_| ()).with_context(|| format!("the {role} role needs --handoff-secret-file (or KVGATE_HANDOFF_SECRET_FILE)"))
}
