//! Command-line interface of `kubectl kvgate`, the kubectl plugin (`operator/src/bin/kubectl-kvgate.rs`):
//! here so that the CLI reference (`docs/cli.md`) is generated from it.

use clap::{Parser, Subcommand};

use crate::crd::Engine;

#[derive(Debug, Parser)]
#[command(
    name = "kubectl kvgate",
    bin_name = "kubectl kvgate",
    about = "Explain kvgate InferenceDeployments: why one is refused or degraded, and the state of all"
)]
pub struct Cli {
    /// The kubeconfig to use (default: $KUBECONFIG, then ~/.kube/config, then in-cluster).
    #[arg(long, global = true, env = "KUBECONFIG")]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// The namespace (default: the kubeconfig context's, else `default`).
    #[arg(short, long, global = true)]
    pub namespace: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
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
        /// llamacpp, vllm, sglang, or kvgate (a router or one worker of kvgate's own, whose pools
        /// are read unsigned: check holds no deployment secret).
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
pub fn parse_engine(s: &str) -> Result<Engine, String> {
    serde_json::from_value(serde_json::Value::String(s.into())).map_err(|_| {
        let names: Vec<&str> = <Engine as strum::VariantArray>::VARIANTS.iter().map(|e| e.as_str()).collect();
        format!("{s:?} is not one of {}", names.join(", "))
    })
}
