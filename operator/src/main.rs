use clap::Parser;
use kvgate_operator::cli::{Cli, Command};

fn main() -> std::process::ExitCode {
    // Before the runtime's threads: the heap the periodic trim can give back whole.
    kvgate_heap::one_arena();
    match tokio::runtime::Runtime::new() {
        Ok(rt) => rt.block_on(run()),
        Err(e) => {
            eprintln!("kvgate-operator: starting the async runtime: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> std::process::ExitCode {
    let cli = Cli::parse();
    let mut traces = None;
    let result = match cli.command {
        Command::Crd => kvgate_operator::crdgen::yaml().and_then(|yaml| print_all(&yaml)),
        Command::Check { service, namespace, port_name, path, timeout } => {
            kvgate_operator::check::check(&service, &namespace, &port_name, &path, std::time::Duration::from_secs(timeout)).await
        }
        Command::Run(args) => {
            traces = Some(kvgate_telemetry::init(cli.log_format, "info,kube=warn", "kvgate-operator"));
            kvgate_operator::run::run(args).await
        }
    };
    let code = match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // With JSON logs the last line a pod writes is an error event like the others.
            kvgate_telemetry::fatal(&format!("kvgate-operator: {e:#}"));
            std::process::ExitCode::FAILURE
        }
    };
    drop(traces); // the spans still queued go out
    code
}

/// Writes `text` to stdout. A reader that stops early (`kvgate-operator crd | head`) is not an
/// error; `print!` panicked on the closed pipe.
fn print_all(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        written => Ok(written?),
    }
}
