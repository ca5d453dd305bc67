//! `kubectl kvgate`: a kubectl plugin (kubectl finds `kubectl-kvgate` on PATH). `why NAME` explains
//! one InferenceDeployment (phase, the refused or degraded revision, each pod's gate against the
//! window, the newest Events, what to change); `list` shows every one with its pools and reason.
//! It reads with the user's kubeconfig (KUBECONFIG, --kubeconfig) and writes nothing.

use clap::{Parser, Subcommand};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kvgate_operator::crd::InferenceDeployment;
use kvgate_operator::{labels, why};

#[derive(Debug, Parser)]
#[command(name = "kubectl kvgate", about = "Explain kvgate InferenceDeployments: why one is refused or degraded, and the state of all")]
struct Cli {
    /// The kubeconfig to use (default: $KUBECONFIG, then ~/.kube/config, then in-cluster).
    #[arg(long, global = true, env = "KUBECONFIG")]
    kubeconfig: Option<std::path::PathBuf>,
    /// The namespace (default: the kubeconfig context's, else `default`).
    #[arg(short, long, global = true)]
    namespace: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Why NAME is not simply Available, and the one thing to change. Exits 1 when it is
    /// Refused, RolledBack or Degraded.
    Why {
        /// The InferenceDeployment's name.
        name: String,
    },
    /// Every InferenceDeployment of the namespace (all namespaces with -A): engine, window,
    /// each role's smallest measured pool, status and reason.
    List {
        /// Every namespace.
        #[arg(short = 'A', long)]
        all_namespaces: bool,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    match run(Cli::parse()).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kubectl kvgate: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<std::process::ExitCode> {
    let config = match &cli.kubeconfig {
        // KUBECONFIG may list several files; the first is the one kubectl writes to.
        Some(path) => {
            let first = std::env::split_paths(path).next().unwrap_or_default();
            kube::Config::from_custom_kubeconfig(Kubeconfig::read_from(&first)?, &KubeConfigOptions::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    let namespace = cli.namespace.clone().unwrap_or_else(|| config.default_namespace.clone());
    let client = kube::Client::try_from(config)?;
    match cli.command {
        Command::Why { name } => {
            let ds: Api<InferenceDeployment> = Api::namespaced(client.clone(), &namespace);
            let d = ds.get_opt(&name).await?.ok_or_else(|| anyhow::anyhow!("no InferenceDeployment {name} in namespace {namespace}"))?;
            let selector = labels::selector_string(&[(labels::INSTANCE.to_string(), name.clone())].into());
            let pods = Api::<Pod>::namespaced(client.clone(), &namespace).list(&ListParams::default().labels(&selector)).await?.items;
            let events = Api::<Event>::namespaced(client, &namespace).list(&ListParams::default()).await?.items;
            print!("{}", why::explain(&d, &pods, &events));
            Ok(if why::unhealthy(&d) { std::process::ExitCode::FAILURE } else { std::process::ExitCode::SUCCESS })
        }
        Command::List { all_namespaces } => {
            let ds: Api<InferenceDeployment> = if all_namespaces { Api::all(client) } else { Api::namespaced(client, &namespace) };
            print!("{}", why::list(&ds.list(&ListParams::default()).await?.items));
            Ok(std::process::ExitCode::SUCCESS)
        }
    }
}
