//! `kubectl kvgate`: a kubectl plugin (kubectl finds `kubectl-kvgate` on PATH). `why NAME` explains
//! one InferenceDeployment (phase, the refused or degraded revision, each pod's gate against the
//! window, the newest Events, what to change); `list` shows every one with its pools and reason;
//! both read with the user's kubeconfig (KUBECONFIG, --kubeconfig) and write nothing. `check URL`
//! asks an engine you already run what the operator would ask its pods, and needs no cluster.

use std::process::ExitCode;

use clap::Parser;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kvgate_operator::crd::InferenceDeployment;
use kvgate_operator::plugin_cli::{Cli, Command};
use kvgate_operator::{engine_check, labels, why};

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
