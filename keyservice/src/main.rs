//! `confed-keyservice`: one operator's key service process, built from this crate alone; the same
//! service and arguments as `confed keyservice` (`docs/operations.md`, "Key services").

use clap::Parser;
use confed_keyservice::cli::{self, KeyserviceArgs, KeyserviceCommand};

/// Holds one Shamir share of each task key and releases it only to an enclave whose attestation
/// its appraisal policy accepts, once per round.
#[derive(Parser)]
#[command(
    name = "confed-keyservice",
    version,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<KeyserviceCommand>,
    #[command(flatten)]
    run: Option<KeyserviceArgs>,
}

fn main() -> std::process::ExitCode {
    // Text on a terminal (colour only there) or JSON lines (CONFED_LOG_FORMAT=json).
    if let Err(error) = confed_ops::init_logs("info") {
        eprintln!("error: {error}");
        return std::process::ExitCode::from(2);
    }
    let cli = Cli::parse();
    cli::owner_only_files();
    confed_protocol::http::install_crypto_provider();
    let outcome = tokio::runtime::Runtime::new()
        .map_err(anyhow::Error::from)
        .and_then(|runtime| {
            // Inside the runtime: the signal handlers are installed on the runtime's driver.
            runtime.block_on(async { cli::run(cli.command, cli.run, cli::shutdown_signal()).await })
        });
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
