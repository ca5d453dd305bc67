use clap::Parser;
use kvgate_operator::cli::{Cli, Command};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Crd => {
            print!("{}", kvgate_operator::crdgen::yaml()?);
            Ok(())
        }
        Command::Check { service, namespace, port_name, path, timeout } => {
            kvgate_operator::check::check(&service, &namespace, &port_name, &path, std::time::Duration::from_secs(timeout)).await
        }
        Command::Run(args) => {
            kvgate_telemetry::init(cli.log_format, "info,kube=warn");
            kvgate_operator::run::run(args).await
        }
    }
}
