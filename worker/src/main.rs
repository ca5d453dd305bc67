use clap::Parser;
use kvgate_worker::cli::{Cli, Command};
use kvgate_worker::commands::{self, roles};

fn main() -> std::process::ExitCode {
    // Before any thread: the heap the periodic trim can give back whole.
    kvgate_heap::one_arena();
    let cli = Cli::parse();
    // While the process has one thread, where a model runs: the compute threads and the heap
    // tuned for model steps. A router computes nothing and keeps glibc's defaults, which give
    // memory back sooner.
    if cli.command.runs_a_model() {
        kvgate_worker::cpu::prepare_model_process();
    }
    let _traces = kvgate_telemetry::init(cli.log_format, "info", cli.command.service_name());
    if cli.check_config {
        return match commands::check::run(&cli.command) {
            Ok(()) => {
                println!("kvgate-worker: the arguments are valid");
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("kvgate-worker: {e:#}");
                std::process::ExitCode::from(2)
            }
        };
    }
    let result = match cli.command {
        Command::Probe(args) => commands::probe::run(args),
        command => tokio::runtime::Runtime::new().map_err(anyhow::Error::from).and_then(|rt| rt.block_on(serve(command))),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            kvgate_telemetry::fatal(&format!("kvgate-worker: {e:#}"));
            std::process::ExitCode::FAILURE
        }
    }
}

async fn serve(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Local(args) => commands::local::run(args).await,
        Command::Router(args) => {
            let secret = roles::secret(&args.secret, "router")?;
            roles::run_single(roles::router(&args, &roles::registry(), secret).await?).await
        }
        Command::Prefill(args) => {
            roles::fault_check()?;
            let secret = roles::secret(&args.secret, "prefill")?;
            roles::run_single(roles::prefill(&args, &roles::registry(), secret, true).await?).await
        }
        Command::Decode(args) => {
            let secret = roles::secret(&args.handoff.secret, "decode")?;
            roles::run_single(roles::decode(&args, &roles::registry(), secret).await?).await
        }
        Command::Probe(_) => unreachable!("probe runs without a runtime"),
    }
}
