//! Command-line interface of `kvgate-worker`.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::kv::{KvDtype, PoolSize};
use crate::model::ModelSource;

#[derive(Debug, Parser)]
#[command(name = "kvgate-worker", version, about = "kvgate's inference worker: a Llama-architecture model over a measured, paged KV pool")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the OpenAI-compatible API on one machine (model, pool and scheduler in one process).
    Local(LocalArgs),
    /// Allocate the KV pool exactly as serving would, print the capacity report, and exit
    /// non-zero when it cannot hold --context-window tokens (a preflight or init container).
    Probe(ProbeArgs),
}

#[derive(Debug, Args)]
pub struct LocalArgs {
    /// Address of the HTTP API.
    #[arg(long, default_value = "127.0.0.1:8080", env = "KVGATE_LISTEN")]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Most prompt + decode tokens in one batched forward pass (prompts are prefilled in chunks).
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_batch_tokens: u32,
    /// How long a request waits for free KV pages before it is answered 503.
    #[arg(long, default_value_t = 30_000)]
    pub admission_timeout_ms: u64,
}

#[derive(Debug, Args)]
pub struct ProbeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Print the report as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Model, window and KV pool settings shared by every command.
#[derive(Debug, Args, Clone)]
pub struct EngineArgs {
    /// `tiny` (built-in, seeded weights) or a checkpoint directory with config.json,
    /// *.safetensors and tokenizer.json.
    #[arg(long, default_value = "tiny", env = "KVGATE_MODEL")]
    pub model: ModelSource,
    /// Declared context window: prompt + completion tokens one request may use.
    #[arg(long, default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..))]
    pub context_window: u64,
    #[command(flatten)]
    pub pool: PoolArgs,
}

#[derive(Debug, Args, Clone)]
#[group(skip)]
pub struct PoolArgs {
    /// KV pool size in bytes (rounded down to whole pages).
    #[arg(long, conflicts_with_all = ["kv_pool_tokens", "kv_memory_fraction"])]
    pub kv_pool_bytes: Option<u64>,
    /// KV pool size in tokens (rounded up to whole pages).
    #[arg(long, conflicts_with = "kv_memory_fraction")]
    pub kv_pool_tokens: Option<u64>,
    /// KV pool size as a fraction (0, 1] of the memory this process may use after loading the
    /// model (respects the cgroup limit). Without any size flag the pool holds four times the
    /// context window.
    #[arg(long)]
    pub kv_memory_fraction: Option<f64>,
    /// Tokens per KV page (a power of two).
    #[arg(long, default_value_t = 16, value_parser = parse_page_size)]
    pub page_size: usize,
    /// Element type of stored K/V.
    #[arg(long, default_value = "f32")]
    pub kv_dtype: KvDtype,
    /// Where the pool lives: `cpu`, or `cuda` / `cuda:N` (needs the `cuda` build feature).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Skip zeroing freed pages (they stay unreadable through the generation check either way).
    #[arg(long)]
    pub no_kv_scrub: bool,
    /// Where to write the capacity report after allocation (for an init container).
    #[arg(long)]
    pub report_file: Option<PathBuf>,
}

impl PoolArgs {
    /// The requested size; four times the window when none is given.
    pub fn size(&self, context_window: u64) -> PoolSize {
        match (self.kv_pool_bytes, self.kv_pool_tokens, self.kv_memory_fraction) {
            (Some(b), _, _) => PoolSize::Bytes(b),
            (_, Some(t), _) => PoolSize::Tokens(t),
            (_, _, Some(f)) => PoolSize::MemoryFraction(f),
            _ => PoolSize::Tokens(context_window.saturating_mul(4)),
        }
    }
}

fn parse_page_size(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if n == 0 || !n.is_power_of_two() || n > 1024 {
        return Err(format!("--page-size must be a power of two between 1 and 1024, got {n}"));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cli_is_well_formed() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn pool_flags_are_exclusive_and_default_to_four_windows() {
        let cli = Cli::try_parse_from(["kvgate-worker", "local"]).unwrap();
        let Command::Local(a) = cli.command else { panic!() };
        assert_eq!(a.engine.pool.size(a.engine.context_window), PoolSize::Tokens(4 * 8192));
        let err = Cli::try_parse_from(["kvgate-worker", "local", "--kv-pool-bytes", "1", "--kv-pool-tokens", "2"]).unwrap_err();
        assert!(err.to_string().contains("cannot be used with"), "{err}");
        let err = Cli::try_parse_from(["kvgate-worker", "local", "--page-size", "12"]).unwrap_err();
        assert!(err.to_string().contains("power of two"), "{err}");
    }
}
