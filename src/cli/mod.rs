//! The `confed` command line: one module per command, each owning its arguments and `run`.

mod demo;
mod devices;
mod keys;
mod privacy;
mod serve;
mod tenant;
mod tokens;
mod verify;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

pub use confed::keyservice::cli::shutdown_signal;
pub use demo::DemoArgs;
pub use devices::DevicesCommand;
pub use keys::KeysCommand;
pub use privacy::PrivacyCommand;
pub use serve::ServeArgs;
pub use tenant::TenantCommand;
pub use verify::VerifyCommand;

#[derive(Parser)]
#[command(
    name = "confed",
    version,
    about = "Confidential-computing federated-learning server"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// The whole system in one process (DEV attestation): a task trained by simulated devices
    /// over several rounds with differential privacy, printing accuracy after each round.
    Demo(DemoArgs),
    /// Run the server: partner API, scheduler and task database in one process.
    Serve(ServeArgs),
    /// Manage tenants (partners) directly in a data directory.
    Tenant {
        #[command(subcommand)]
        command: TenantCommand,
    },
    /// Task encryption keys: the generation ceremony.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Simulated devices: the device client library driven at scale, also the load generator.
    Devices {
        #[command(subcommand)]
        command: DevicesCommand,
    },
    /// Run one key service (one operator's share holder), or check its audit log.
    #[command(args_conflicts_with_subcommands = true)]
    Keyservice {
        #[command(subcommand)]
        command: Option<confed::keyservice::cli::KeyserviceCommand>,
        #[command(flatten)]
        run: Option<confed::keyservice::cli::KeyserviceArgs>,
    },
    /// Run the device-token issuer (Privacy Pass attester and issuer), or make its signing key:
    /// the same as the `confed-issuer` binary.
    #[command(args_conflicts_with_subcommands = true)]
    Issuer {
        #[command(subcommand)]
        command: Option<confed_issuer::cli::IssuerCommand>,
        #[command(flatten)]
        run: Option<confed_issuer::cli::IssuerArgs>,
    },
    /// Check what a server published, against your own trust file.
    Verify {
        #[command(subcommand)]
        command: VerifyCommand,
    },
    /// Privacy budgets: the noise a budget buys and what each round spends.
    Privacy {
        #[command(subcommand)]
        command: PrivacyCommand,
    },
}

pub fn run() -> Result<()> {
    let cli = Cli::parse();
    // The demo reports its own progress; its components' info logs would bury it.
    let default_filter = match cli.command {
        Command::Demo(_) => "warn",
        _ => "info,sqlx=warn",
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .init();
    // Whatever a server or key service writes (databases, logs, blobs, keys) is for its owner
    // only (docs/operations.md).
    if matches!(
        cli.command,
        Command::Serve(_) | Command::Keyservice { .. } | Command::Issuer { .. }
    ) {
        // SAFETY: umask only sets the process's file-creation mask; it cannot fail.
        unsafe { libc::umask(0o077) };
    }
    // One crypto backend for rustls, chosen explicitly (see docs/architecture.md).
    confed_protocol::http::install_crypto_provider();
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async {
        match cli.command {
            Command::Demo(args) => demo::run(args).await,
            Command::Serve(args) => serve::run(args).await,
            Command::Tenant { command } => tenant::run(command).await,
            Command::Keys { command } => keys::run(command),
            Command::Devices { command } => devices::run(command).await,
            Command::Issuer { command, run } => {
                confed_issuer::cli::run(command, run, shutdown_signal()).await
            }
            Command::Keyservice { command, run } => {
                confed::keyservice::cli::run(command, run, shutdown_signal()).await
            }
            Command::Verify { command } => verify::run(command).await,
            Command::Privacy { command } => privacy::run(command),
        }
    })
}
