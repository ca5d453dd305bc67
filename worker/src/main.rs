use clap::Parser;
use kvgate_worker::cli::{Cli, Command};
use kvgate_worker::commands;

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Probe(args) => commands::probe::run(args),
        Command::Local(args) => tokio::runtime::Runtime::new()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(commands::local::run(args))),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvgate-worker: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
