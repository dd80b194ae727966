//! The `confed` command line: one module per command, each owning its arguments and `run`.

#[cfg(feature = "embedded")]
mod demo;
#[cfg(feature = "embedded")]
mod devices;
#[cfg(all(test, feature = "embedded"))]
mod help_tests;
#[cfg(feature = "embedded")]
mod keys;
#[cfg(feature = "embedded")]
mod privacy;
#[cfg(feature = "embedded")]
mod privacy_analytics;
mod serve;
mod tenant;
mod tokens;
mod verify;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

pub(crate) use confed_serving::shutdown_signal;
#[cfg(feature = "embedded")]
pub(crate) use demo::DemoArgs;
#[cfg(feature = "embedded")]
pub(crate) use devices::DevicesCommand;
#[cfg(feature = "embedded")]
pub(crate) use keys::KeysCommand;
#[cfg(feature = "embedded")]
pub(crate) use privacy::PrivacyCommand;
pub(crate) use serve::ServeArgs;
pub(crate) use tenant::TenantCommand;
pub(crate) use verify::VerifyCommand;

#[derive(Parser)]
#[command(
    name = "confed",
    version,
    about = "Confidential-computing federated-learning server"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    #[cfg(feature = "embedded")]
    /// The whole system in one process (DEV attestation): a task trained by simulated devices
    /// over several rounds with differential privacy, printing accuracy after each round.
    Demo(DemoArgs),
    /// Run the server: partner API, scheduler and task database in one process.
    Serve(Box<ServeArgs>),
    /// Manage tenants (partners) directly in a data directory.
    Tenant {
        #[command(subcommand)]
        command: TenantCommand,
    },
    #[cfg(feature = "embedded")]
    /// Task encryption keys: the generation ceremony.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    #[cfg(feature = "embedded")]
    /// Simulated devices: the device client library driven at scale, also the load generator.
    Devices {
        #[command(subcommand)]
        command: DevicesCommand,
    },
    #[cfg(feature = "embedded")]
    /// Run one key service (one operator's share holder), or check its audit log.
    #[command(args_conflicts_with_subcommands = true)]
    Keyservice {
        #[command(subcommand)]
        command: Option<confed::keyservice::cli::KeyserviceCommand>,
        #[command(flatten)]
        run: Option<confed::keyservice::cli::KeyserviceArgs>,
    },
    #[cfg(feature = "embedded")]
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
    #[cfg(feature = "embedded")]
    /// Privacy budgets: the noise a budget buys and what each round spends.
    Privacy {
        #[command(subcommand)]
        command: PrivacyCommand,
    },
}

impl Command {
    /// Whether the command writes files only their owner may read (databases, logs, blobs, keys).
    fn writes_owner_files(&self) -> bool {
        match self {
            Command::Serve(_) => true,
            #[cfg(feature = "embedded")]
            Command::Keyservice { .. } | Command::Issuer { .. } => true,
            _ => false,
        }
    }
}

pub(crate) fn run() -> Result<()> {
    let cli = Cli::parse();
    // The demo reports its own progress; its components' info logs would bury it.
    let default_filter = match cli.command {
        #[cfg(feature = "embedded")]
        Command::Demo(_) => "warn",
        _ => "info,sqlx=warn",
    };
    // Text on a terminal (colour only there) or JSON lines (CONFED_LOG_FORMAT=json).
    confed_ops::init_logs(default_filter)?;
    // Whatever a server or key service writes (databases, logs, blobs, keys) is for its owner
    // only (docs/operations.md).
    if cli.command.writes_owner_files() {
        // SAFETY: umask only sets the process's file-creation mask; it cannot fail.
        unsafe { libc::umask(0o077) };
    }
    // One crypto backend for rustls, chosen explicitly (see docs/architecture.md).
    confed_protocol::http::install_crypto_provider();
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async {
        match cli.command {
            #[cfg(feature = "embedded")]
            Command::Demo(args) => demo::run(args).await,
            Command::Serve(args) => serve::run(*args).await,
            Command::Tenant { command } => tenant::run(command).await,
            #[cfg(feature = "embedded")]
            Command::Keys { command } => keys::run(command),
            #[cfg(feature = "embedded")]
            Command::Devices { command } => devices::run(command).await,
            #[cfg(feature = "embedded")]
            Command::Issuer { command, run } => {
                confed_issuer::cli::run(command, run, shutdown_signal()).await
            }
            #[cfg(feature = "embedded")]
            Command::Keyservice { command, run } => {
                confed::keyservice::cli::run(command, run, shutdown_signal()).await
            }
            Command::Verify { command } => verify::run(command).await,
            #[cfg(feature = "embedded")]
            Command::Privacy { command } => privacy::run(command),
        }
    })
}
