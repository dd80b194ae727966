//! `confed-issuer`: the token issuer process, built from this crate alone; the same service and
//! arguments as `confed issuer` (`docs/operations.md`, "Token issuer").

use clap::Parser;
use confed_issuer::cli::{self, IssuerArgs, IssuerCommand};

/// Grants attested devices at most L blind-signed Privacy Pass tokens per window.
#[derive(Parser)]
#[command(
    name = "confed-issuer",
    version,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<IssuerCommand>,
    #[command(flatten)]
    run: Option<IssuerArgs>,
}

fn main() -> std::process::ExitCode {
    // Text on a terminal (colour only there) or JSON lines (CONFED_LOG_FORMAT=json).
    if let Err(error) = confed_ops::init_logs("info") {
        eprintln!("error: {error}");
        return std::process::ExitCode::from(2);
    }
    let cli = Cli::parse();
    // SAFETY: umask only sets the process's file-creation mask; it cannot fail.
    unsafe { libc::umask(0o077) };
    confed_protocol::http::install_crypto_provider();
    let outcome = tokio::runtime::Runtime::new()
        .map_err(anyhow::Error::from)
        .and_then(|runtime| {
            runtime.block_on(async {
                cli::run(cli.command, cli.run, confed_serving::shutdown_signal()).await
            })
        });
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
