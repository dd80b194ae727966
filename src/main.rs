//! The `confed` command line.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use confed::api::Limits;
use confed::auth::AdminToken;
use confed::clock::{Clock, SystemClock, rfc3339};
use confed::db::NewTenant;
use confed::server::{self, ServeConfig, TlsFiles};

#[derive(Parser)]
#[command(
    name = "confed",
    version,
    about = "Confidential-computing federated-learning server"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the server: partner API, scheduler and task database in one process.
    Serve(ServeArgs),
    /// Manage tenants (partners) directly in a data directory.
    Tenant {
        #[command(subcommand)]
        command: TenantCommand,
    },
}

#[derive(Args)]
struct DataDir {
    /// Directory holding the task database and blobs.
    #[arg(long, default_value = "./confed-data")]
    data_dir: PathBuf,
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    data: DataDir,
    /// Address to listen on; plain HTTP only on loopback addresses.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// PEM certificate chain for TLS (with --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key for TLS (with --tls-cert).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// File holding the admin token (else the CONFED_ADMIN_TOKEN environment variable; with
    /// neither, the admin API is off).
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
    /// Largest model upload in bytes.
    #[arg(long, default_value_t = Limits::default().model_bytes)]
    max_model_bytes: usize,
    /// Seconds between scheduler passes (round deadlines).
    #[arg(long, default_value_t = 1)]
    scheduler_period_seconds: u64,
}

#[derive(Subcommand)]
enum TenantCommand {
    /// Create a tenant and print its API token (alone, on stdout). The token is not stored.
    Create {
        name: String,
        #[command(flatten)]
        data: DataDir,
        #[arg(long, default_value_t = confed::api::admin::DEFAULT_MAX_ACTIVE_TASKS)]
        max_active_tasks: i64,
        #[arg(long, default_value_t = confed::api::admin::DEFAULT_MAX_REPORT_GOAL)]
        max_report_goal: i64,
    },
    /// List tenants (never their tokens).
    List {
        #[command(flatten)]
        data: DataDir,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .init();
    // One crypto backend for rustls, chosen explicitly (see docs/architecture.md).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => serve(args).await,
            Command::Tenant { command } => tenant(command).await,
        }
    })
}

fn admin_token(file: Option<&PathBuf>) -> Result<Option<AdminToken>> {
    let secret = match file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the admin token file {}", path.display()))?,
        ),
        None => std::env::var("CONFED_ADMIN_TOKEN")
            .ok()
            .filter(|t| !t.is_empty()),
    };
    secret
        .map(AdminToken::from_secret)
        .transpose()
        .context("the admin token is unusable")
}

async fn serve(args: ServeArgs) -> Result<()> {
    let tls = match (args.tls_cert, args.tls_key) {
        (Some(cert), Some(key)) => Some(TlsFiles { cert, key }),
        _ => None,
    };
    let config = ServeConfig {
        data_dir: args.data.data_dir,
        listen: args.listen,
        tls,
        admin: admin_token(args.admin_token_file.as_ref())?,
        limits: Limits {
            model_bytes: args.max_model_bytes,
            ..Limits::default()
        },
        scheduler_period: Duration::from_secs(args.scheduler_period_seconds.max(1)),
    };
    server::serve(config, shutdown_signal()).await?;
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = interrupt => {},
            _ = terminate.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
    tracing::info!("shutdown signal received; draining");
}

async fn tenant(command: TenantCommand) -> Result<()> {
    match command {
        TenantCommand::Create {
            name,
            data,
            max_active_tasks,
            max_report_goal,
        } => {
            let request = confed::api::admin::CreateTenantRequest {
                name,
                max_active_tasks: Some(max_active_tasks),
                max_report_goal: Some(max_report_goal),
            };
            let new: NewTenant = match request.validate() {
                Ok(new) => new,
                Err(problems) => {
                    let text: Vec<_> = problems
                        .iter()
                        .map(|p| format!("{} {}", p.name, p.reason))
                        .collect();
                    bail!("invalid tenant: {}", text.join("; "));
                }
            };
            let (db, _) = server::open_data_dir(&data.data_dir).await?;
            let (tenant, token) = db.create_tenant(&new, SystemClock.now_millis()).await?;
            db.close().await;
            eprintln!(
                "created tenant {} ({}); its token follows, shown only this once",
                tenant.name, tenant.id
            );
            println!("{}", token.as_str());
        }
        TenantCommand::List { data } => {
            let (db, _) = server::open_data_dir(&data.data_dir).await?;
            for t in db.list_tenants().await? {
                println!(
                    "{}\t{}\tmax_active_tasks={}\tmax_report_goal={}\tcreated {}",
                    t.name,
                    t.id,
                    t.max_active_tasks,
                    t.max_report_goal,
                    rfc3339(t.created_at)
                );
            }
            db.close().await;
        }
    }
    Ok(())
}
