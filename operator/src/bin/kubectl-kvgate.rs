//! `kubectl kvgate`: a kubectl plugin (kubectl finds `kubectl-kvgate` on PATH). `why NAME` explains
//! one InferenceDeployment (phase, the refused or degraded revision, each pod's gate against the
//! window, the newest Events, what to change); `list` shows every one with its pools and reason;
//! both read with the user's kubeconfig (KUBECONFIG, --kubeconfig) and write nothing. `check URL`
//! asks an engine you already run what the operator would ask its pods, and needs no cluster.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kvgate_operator::crd::{Engine, InferenceDeployment};
use kvgate_operator::{engine_check, labels, why};

#[derive(Debug, Parser)]
#[command(
    name = "kubectl kvgate",
    bin_name = "kubectl kvgate",
    about = "Explain kvgate InferenceDeployments: why one is refused or degraded, and the state of all"
)]
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
    /// Would the engine serving at URL pass kvgate's gate for --window? Reads what one request
    /// may use through the engine's own API, then runs the integrity canary with the boundary
    /// and stale-KV probes. Exits 0 when it passes, 1 when it is refused (the reason and the
    /// engine's numbers are printed), 2 when it cannot be checked. Through `kubectl
    /// port-forward` for a pod.
    Check {
        /// The server, e.g. http://127.0.0.1:8080.
        url: String,
        /// llamacpp, vllm or sglang.
        #[arg(long, value_parser = parse_engine)]
        engine: Engine,
        /// The context window the server is to serve (tokens).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        window: u64,
        /// Canary prompts (as spec.rollout.canary.prompts).
        #[arg(long, default_value_t = 3)]
        prompts: u32,
        /// Tokens generated per canary prompt.
        #[arg(long, default_value_t = 8)]
        max_tokens: u32,
        /// Longest canary prompt (tokens).
        #[arg(long, default_value_t = 4096)]
        max_prompt_tokens: u64,
        /// Prompts that fill the pool before the compared prompts are asked again (0: no
        /// stale-KV probe).
        #[arg(long, default_value_t = 4)]
        stale_kv_fillers: u32,
        /// A prompt of the whole window is asked only up to this window.
        #[arg(long, default_value_t = 131_072)]
        max_probe_tokens: u64,
    },
}

/// An engine by the name its spec gives.
fn parse_engine(s: &str) -> Result<Engine, String> {
    serde_json::from_value(serde_json::Value::String(s.into())).map_err(|_| {
        let names: Vec<&str> = <Engine as strum::VariantArray>::VARIANTS.iter().map(|e| e.as_str()).collect();
        format!("{s:?} is not one of {}", names.join(", "))
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match run(Cli::parse()).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kubectl kvgate: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Check { url, engine, window, prompts, max_tokens, max_prompt_tokens, stale_kv_fillers, max_probe_tokens } => {
            let o = engine_check::Options { engine, url, window, prompts, max_tokens, max_prompt_tokens, stale_kv_fillers, max_probe_tokens };
            check(&o).await
        }
        Command::Why { name } => {
            let (client, namespace) = client(cli.kubeconfig.as_deref(), cli.namespace).await?;
            let ds: Api<InferenceDeployment> = Api::namespaced(client.clone(), &namespace);
            let d = ds.get_opt(&name).await?.ok_or_else(|| anyhow::anyhow!("no InferenceDeployment {name} in namespace {namespace}"))?;
            let selector = labels::selector_string(&[(labels::INSTANCE.to_string(), name.clone())].into());
            let pods = Api::<Pod>::namespaced(client.clone(), &namespace).list(&ListParams::default().labels(&selector)).await?.items;
            let events = Api::<Event>::namespaced(client, &namespace).list(&ListParams::default()).await?.items;
            print!("{}", why::explain(&d, &pods, &events));
            Ok(if why::unhealthy(&d) { ExitCode::FAILURE } else { ExitCode::SUCCESS })
        }
        Command::List { all_namespaces } => {
            let (client, namespace) = client(cli.kubeconfig.as_deref(), cli.namespace).await?;
            let ds: Api<InferenceDeployment> = if all_namespaces { Api::all(client) } else { Api::namespaced(client, &namespace) };
            print!("{}", why::list(&ds.list(&ListParams::default()).await?.items));
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// A client from `kubeconfig` (KUBECONFIG may list several files; the first is the one kubectl
/// writes to), else the usual places; and the namespace to read.
async fn client(kubeconfig: Option<&std::path::Path>, namespace: Option<String>) -> anyhow::Result<(kube::Client, String)> {
    let config = match kubeconfig {
        Some(path) => {
            let first = std::env::split_paths(path).next().unwrap_or_default();
            kube::Config::from_custom_kubeconfig(Kubeconfig::read_from(&first)?, &KubeConfigOptions::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    let namespace = namespace.unwrap_or_else(|| config.default_namespace.clone());
    Ok((kube::Client::try_from(config)?, namespace))
}

async fn check(o: &engine_check::Options) -> anyhow::Result<ExitCode> {
    match engine_check::check(&reqwest::Client::new(), o).await.map_err(anyhow::Error::msg)? {
        engine_check::Verdict::Passed(message) => {
            println!("passed: {message}");
            Ok(ExitCode::SUCCESS)
        }
        engine_check::Verdict::Refused { reason, message } => {
            println!("refused ({reason}): {message}");
            Ok(ExitCode::FAILURE)
        }
    }
}
