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
        command: Option<KeyserviceCommand>,
        #[command(flatten)]
        run: Option<KeyserviceArgs>,
    },
    /// Check what a server published, against your own trust file.
    Verify {
        #[command(subcommand)]
        command: VerifyCommand,
    },
}

#[derive(Subcommand)]
enum VerifyCommand {
    /// A round's release: the enclave's signature and t key services' receipts for its
    /// commitment, checked offline against the key services' verifying keys in the trust file.
    /// The tenant token comes from --token-file or CONFED_TOKEN.
    Release {
        #[arg(long)]
        server: String,
        #[arg(long)]
        task: String,
        #[arg(long)]
        round: u64,
        /// Trust file: {"threshold", "keyservices": [{"id", "verifying_key"}], ...}.
        #[arg(long)]
        trust: PathBuf,
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// The task policy text you expect (e.g. saved from GET /v1/tasks/{id} when you created
        /// the task): the release must name exactly it.
        #[arg(long)]
        policy: Option<PathBuf>,
    },
}

#[derive(clap::Args)]
struct DemoArgs {
    /// Simulated devices in the population.
    #[arg(long, default_value_t = 300)]
    devices: usize,
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Devices aggregated per round.
    #[arg(long, default_value_t = 100)]
    report_goal: u32,
    /// Total privacy budget over all rounds.
    #[arg(long, default_value_t = 4.0)]
    epsilon: f64,
    #[arg(long, default_value_t = 1e-6)]
    delta: f64,
    #[arg(long, default_value_t = 1.0)]
    clip_norm: f64,
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Where the demo keeps its state (default: a new directory under the system's temp dir,
    /// removed at the end).
    #[arg(long)]
    data_dir: Option<PathBuf>,
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Create an HPKE key pair, split its private key into N Shamir shares (any T recover it),
    /// write one share file per key service and the public key set. The private key is never
    /// written.
    Generate {
        /// Number of key services (N), 2-255.
        #[arg(long)]
        shares: u16,
        /// Shares needed to recover the key (T), 2..=N.
        #[arg(long)]
        threshold: u16,
        /// Directory for the share files and keyset.json.
        #[arg(long)]
        out: PathBuf,
        /// Start of validity (RFC 3339); default now.
        #[arg(long)]
        valid_from: Option<String>,
        /// End of validity (RFC 3339); default 30 days after the start.
        #[arg(long)]
        valid_until: Option<String>,
        /// Allow a threshold of at most half the shares (the release ledger's one-release rule
        /// then rests on no key service): for development key sets only.
        #[arg(long)]
        development: bool,
    },
    /// DEV ONLY: create a dev attester key (P-256 PKCS#8 PEM) if missing and write its public key
    /// set next to it (`<stem>.jwks.json`), for key services on `policies/dev.toml` to load before
    /// `confed-enclave --attester dev --dev-key FILE` starts.
    DevAttester {
        #[arg(long)]
        key: PathBuf,
    },
}

#[derive(Subcommand)]
enum DevicesCommand {
    /// Run N devices that check in, train on private non-IID shards of a synthetic data set, seal
    /// their updates and upload them.
    Simulate {
        /// Base URL of `confed serve`.
        #[arg(long)]
        server: String,
        #[arg(long)]
        population: String,
        #[arg(long, default_value_t = 100)]
        devices: usize,
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        /// Contributions per device before it stops.
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        /// Device trust configuration: {"threshold": T, "keyservices": [{"id", "verifying_key"}],
        /// "limits": {"max_epsilon", "max_delta", "min_reports"}}.
        #[arg(long)]
        trust: PathBuf,
        /// Send random updates of the model's shape instead of training (load generator).
        #[arg(long)]
        no_train: bool,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value_t = 200)]
        rows_per_device: usize,
        /// Longest wait when told to retry, in milliseconds (real devices wait the whole window).
        #[arg(long, default_value_t = 200)]
        max_retry_wait_ms: u64,
        /// Consecutive retry answers after which a device stops.
        #[arg(long, default_value_t = 3)]
        idle_limit: usize,
        #[arg(long, default_value = "1.0.0")]
        client_version: String,
    },
    /// Write the synthetic task's initial model (zeros, safetensors) to upload as version 0.
    InitModel {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Fetch key services' verifying keys into a device trust configuration (check the keys with
    /// each operator out of band: this trusts whatever answers).
    TrustConfig {
        #[arg(long = "keyservice", required = true)]
        keyservices: Vec<String>,
        #[arg(long)]
        threshold: usize,
        /// Largest total epsilon of a task the device contributes to.
        #[arg(long)]
        max_epsilon: f64,
        /// Largest delta of a task the device contributes to.
        #[arg(long)]
        max_delta: f64,
        /// Fewest contributions (the policy's min_reports) a release may average.
        #[arg(long)]
        min_reports: u32,
        /// Pin the tenant (id) the device works for: other tenants' tasks are refused.
        #[arg(long)]
        tenant_id: Option<String>,
    },
}

#[derive(Subcommand)]
enum KeyserviceCommand {
    /// Hash-chained audit log tools.
    Audit {
        #[command(subcommand)]
        command: AuditCommand,
    },
}

#[derive(Subcommand)]
enum AuditCommand {
    /// Verify every record's chain hash and signature; print the head (records, hash) to compare
    /// with a signed head kept elsewhere (GET /v1/audit/head).
    Verify {
        file: PathBuf,
        /// The key service's id (signatures are bound to it).
        #[arg(long)]
        id: String,
        /// The key service's verifying key as `GET /v1/keys` publishes it (base64url SEC1) ...
        #[arg(
            long,
            conflicts_with = "signing_key",
            required_unless_present = "signing_key"
        )]
        verifying_key: Option<String>,
        /// ... or its signing key file (PKCS#8 PEM), on the operator's own machine.
        #[arg(long)]
        signing_key: Option<PathBuf>,
    },
}

#[derive(Args)]
struct KeyserviceArgs {
    /// This key service's id (1-64 of A-Z a-z 0-9 . _ -), bound into signatures and releases.
    #[arg(long)]
    id: String,
    /// Share files this service holds (one per key).
    #[arg(long = "share", required = true)]
    shares: Vec<PathBuf>,
    /// Appraisal policy (TOML), e.g. policies/confidential-space.toml.
    #[arg(long)]
    policy: PathBuf,
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: SocketAddr,
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// P-256 key that signs the key set (PKCS#8 PEM); created if missing.
    #[arg(long)]
    signing_key: PathBuf,
    /// Append-only, hash-chained decision log.
    #[arg(long)]
    audit_log: PathBuf,
    /// The `aud` tokens must carry; default `confed-keyservice/<id>`.
    #[arg(long)]
    audience: Option<String>,
}

#[derive(Args)]
struct DataDir {
    /// Directory holding the task database (unless --database), blobs and contributions.
    #[arg(long, default_value = "./confed-data")]
    data_dir: PathBuf,
    /// Task database on PostgreSQL (`postgres://user@host:port/db`) instead of the data
    /// directory's SQLite file.
    #[arg(long, env = "CONFED_DATABASE_URL")]
    database: Option<String>,
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    data: DataDir,
    /// Blobs and device contributions in Google Cloud Storage (`gs://bucket/prefix`) instead of
    /// the data directory; devices then upload through signed URLs. Credentials come from the
    /// environment (Application Default Credentials; the metadata server on GCP).
    #[arg(long, env = "CONFED_BLOBS")]
    blobs: Option<String>,
    /// A GCS endpoint other than Google's: only an emulator on plain http:// at a loopback
    /// address (tests, deploy/local).
    #[arg(long, env = "CONFED_GCS_ENDPOINT", requires = "blobs")]
    gcs_endpoint: Option<String>,
    /// A service account key (JSON) that signs device upload URLs locally, instead of IAM
    /// signBlob as the ambient identity (one network call per check-in).
    #[arg(long, env = "CONFED_GCS_SIGNING_KEY_FILE", requires = "blobs")]
    gcs_signing_key_file: Option<PathBuf>,
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
    /// File holding the token `confed-enclave` worker processes present (else the
    /// CONFED_WORKER_TOKEN environment variable; with neither, the worker API is off).
    #[arg(long)]
    worker_token_file: Option<PathBuf>,
    /// Largest model upload in bytes.
    #[arg(long, default_value_t = Limits::default().model_bytes)]
    max_model_bytes: usize,
    /// Base URL of a key service whose signed key set devices receive (repeat for each).
    #[arg(long = "keyservice")]
    keyservices: Vec<String>,
    /// What this process does (repeat for several; default all three, or api and scheduler
    /// with --keyservice). API replicas,
    /// schedulers and workers can run apart on one PostgreSQL database (`--database`).
    #[arg(long = "role", value_enum)]
    roles: Vec<server::Role>,
    /// Seconds between scheduler passes (round deadlines).
    #[arg(long, default_value_t = 1)]
    scheduler_period_seconds: u64,
    /// Minutes a closed round's contributions are kept before retention deletes them (default
    /// one week; at least 1).
    #[arg(long, default_value_t = 10080)]
    retention_minutes: u64,
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

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            // One readable line (with its causes), not a backtrace: this is what operators see.
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
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
    if matches!(cli.command, Command::Serve(_) | Command::Keyservice { .. }) {
        // SAFETY: umask only sets the process's file-creation mask; it cannot fail.
        unsafe { libc::umask(0o077) };
    }
    // One crypto backend for rustls, chosen explicitly (see docs/architecture.md).
    confed_enclave::http::install_crypto_provider();
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async {
        match cli.command {
            Command::Demo(args) => demo(args).await,
            Command::Serve(args) => serve(args).await,
            Command::Tenant { command } => tenant(command).await,
            Command::Keys { command } => keys(command),
            Command::Devices { command } => devices(command).await,
            Command::Keyservice { command, run } => keyservice(command, run).await,
            Command::Verify { command } => verify(command).await,
        }
    })
}

async fn verify(command: VerifyCommand) -> Result<()> {
    let VerifyCommand::Release {
        server,
        task,
        round,
        trust,
        token_file,
        policy,
    } = command;
    let policy = policy
        .map(|path| {
            std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
        })
        .transpose()?;
    let token = match &token_file {
        Some(path) => zeroize::Zeroizing::new(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?
                .trim()
                .to_string(),
        ),
        None => zeroize::Zeroizing::new(std::env::var("CONFED_TOKEN").map_err(|_| {
            anyhow::anyhow!("give the tenant token with --token-file FILE or CONFED_TOKEN")
        })?),
    };
    let trust = confed::device::TrustConfig::load(&trust)?;
    let verified = confed::verify::verify_release_under(
        &server,
        &token,
        &task,
        round,
        &trust,
        policy.as_deref(),
    )
    .await?;
    for line in &verified.lines {
        println!("{line}");
    }
    if verified.ok() {
        println!("release of round {round} of task {task}: VERIFIED");
        Ok(())
    } else {
        anyhow::bail!(
            "release of round {round} of task {task} does NOT verify: {}",
            verified.failures.join("; ")
        )
    }
}

fn audit_verify(
    file: &std::path::Path,
    id: &str,
    verifying_key: Option<&str>,
    signing_key: Option<&std::path::Path>,
) -> Result<()> {
    use confed::keyservice::audit::{SignatureCheck, verify_file_signed};
    let key = match (verifying_key, signing_key) {
        (Some(text), _) => confed_attestation::exchange::decode_verifying_key(text)
            .context("--verifying-key is not a base64url SEC1 P-256 point")?,
        (None, Some(path)) => *confed::keyservice::load_existing_signing_key(path)?.verifying_key(),
        (None, None) => bail!("pass --verifying-key or --signing-key"),
    };
    let verified = verify_file_signed(
        file,
        SignatureCheck {
            keyservice_id: id,
            verifying_key: &key,
        },
    )?;
    if verified.unsigned > 0 {
        bail!(
            "the first {} of {} records are unsigned (written before signed heads, or stripped by a rewrite): compare the head {} with a signed head kept elsewhere before trusting them",
            verified.unsigned,
            verified.head.records,
            verified.head.hash
        );
    }
    println!(
        "audit log intact and signed by key service {id}: {} records, head {}",
        verified.head.records, verified.head.hash
    );
    Ok(())
}

fn admin_token(file: Option<&PathBuf>) -> Result<Option<AdminToken>> {
    shared_token(file, "CONFED_ADMIN_TOKEN", "admin")
}

/// A bearer secret from a file, else from the environment variable `env`; `None` with neither.
fn shared_token(file: Option<&PathBuf>, env: &str, what: &str) -> Result<Option<AdminToken>> {
    let secret = match file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the {what} token file {}", path.display()))?,
        ),
        None => std::env::var(env).ok().filter(|t| !t.is_empty()),
    };
    secret
        .map(AdminToken::from_secret)
        .transpose()
        .with_context(|| format!("the {what} token is unusable"))
}

async fn demo(args: DemoArgs) -> Result<()> {
    let (data_dir, temporary) = match args.data_dir {
        Some(dir) => (dir, false),
        None => {
            let unique = format!(
                "confed-demo-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis())
                    .unwrap_or_default()
            );
            (std::env::temp_dir().join(unique), true)
        }
    };
    let outcome = confed::demo::run(confed::demo::DemoOptions {
        devices: args.devices,
        rounds: args.rounds,
        report_goal: args.report_goal,
        epsilon: args.epsilon,
        delta: args.delta,
        clip_norm: args.clip_norm,
        seed: args.seed,
        data_dir: data_dir.clone(),
        progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
    })
    .await;
    if temporary {
        let _ = std::fs::remove_dir_all(&data_dir);
    }
    outcome?;
    Ok(())
}

async fn serve(args: ServeArgs) -> Result<()> {
    let tls = match (args.tls_cert, args.tls_key) {
        (Some(cert), Some(key)) => Some(TlsFiles { cert, key }),
        _ => None,
    };
    let mut roles = args.roles;
    if roles.is_empty() {
        // By default everything this layout can run: with remote key services the enclave
        // workers are confed-enclave processes, so the in-process worker is not among them.
        roles = server::Role::ALL.to_vec();
        if !args.keyservices.is_empty() {
            roles.retain(|r| *r != server::Role::EnclaveWorker);
        }
    }
    roles.sort_by_key(|r| *r as u8);
    roles.dedup();
    let blobs = match &args.blobs {
        Some(url) => Some(confed::blob::GcsConfig {
            endpoint: args.gcs_endpoint.clone(),
            signing_key_file: args.gcs_signing_key_file.clone(),
            ..confed::blob::GcsConfig::parse(url)?
        }),
        None => None,
    };
    let config = ServeConfig {
        roles,
        blobs,
        data_dir: args.data.data_dir,
        database: args.data.database,
        keyservices: args.keyservices,
        listen: args.listen,
        tls,
        admin: admin_token(args.admin_token_file.as_ref())?,
        worker_token: shared_token(
            args.worker_token_file.as_ref(),
            "CONFED_WORKER_TOKEN",
            "worker",
        )?,
        limits: Limits {
            model_bytes: args.max_model_bytes,
            ..Limits::default()
        },
        scheduler_period: Duration::from_secs(args.scheduler_period_seconds.max(1)),
        retention: Duration::from_secs(args.retention_minutes.max(1) * 60),
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
            let (db, _) = server::open_data_dir(&data.data_dir, data.database.as_deref()).await?;
            let (tenant, token) = db.create_tenant(&new, SystemClock.now_millis()).await?;
            db.close().await;
            eprintln!(
                "created tenant {} ({}); its token follows, shown only this once",
                tenant.name, tenant.id
            );
            println!("{}", token.as_str());
        }
        TenantCommand::List { data } => {
            let (db, _) = server::open_data_dir(&data.data_dir, data.database.as_deref()).await?;
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

fn parse_time(text: Option<&str>, default: i64) -> Result<i64> {
    match text {
        None => Ok(default),
        Some(text) => {
            let time =
                time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
                    .with_context(|| {
                    format!("{text:?} is not an RFC 3339 time like 2027-01-01T00:00:00Z")
                })?;
            Ok(time.unix_timestamp())
        }
    }
}

fn keys(command: KeysCommand) -> Result<()> {
    match command {
        KeysCommand::DevAttester { key } => {
            let attester =
                confed_attestation::DevAttester::from_key_file(&key, std::sync::Arc::new(|| 0))
                    .map_err(anyhow::Error::msg)?;
            drop(attester);
            println!(
                "dev attester key {} and its key set {} (DEV ONLY: trusted by policies/dev.toml, protects nothing)",
                key.display(),
                key.with_extension("jwks.json").display()
            );
        }
        KeysCommand::Generate {
            shares,
            threshold,
            out,
            valid_from,
            valid_until,
            development,
        } => {
            confed::keys::ceremony::check_quorum(threshold, shares, development)?;
            let now = SystemClock.now_millis() / 1000;
            let not_before = parse_time(valid_from.as_deref(), now)?;
            let not_after = parse_time(valid_until.as_deref(), not_before + 30 * 24 * 3600)?;
            let outcome =
                confed::keys::ceremony::generate(&confed::keys::ceremony::CeremonyOptions {
                    shares,
                    threshold,
                    out_dir: out,
                    not_before,
                    not_after,
                })?;
            println!(
                "key {} ({threshold}-of-{shares}), valid {} to {}",
                outcome.key.key_id,
                rfc3339(not_before * 1000),
                rfc3339(not_after * 1000)
            );
            println!("public key set: {}", outcome.key_set_file.display());
            for path in &outcome.share_files {
                println!("share: {}", path.display());
            }
            eprintln!(
                "hand each share file to its key service operator over a secure channel, then delete it here"
            );
        }
    }
    Ok(())
}

async fn keyservice(command: Option<KeyserviceCommand>, run: Option<KeyserviceArgs>) -> Result<()> {
    if let Some(KeyserviceCommand::Audit {
        command:
            AuditCommand::Verify {
                file,
                id,
                verifying_key,
                signing_key,
            },
    }) = command
    {
        return audit_verify(&file, &id, verifying_key.as_deref(), signing_key.as_deref());
    }
    let Some(args) = run else {
        bail!(
            "pass --id, --share, --policy, --signing-key and --audit-log to run a key service, or `audit verify FILE`"
        );
    };
    let tls = match (args.tls_cert, args.tls_key) {
        (Some(cert), Some(key)) => Some(TlsFiles { cert, key }),
        _ => None,
    };
    let audience = args
        .audience
        .unwrap_or_else(|| format!("confed-keyservice/{}", args.id));
    let config = confed::keyservice::serve::KeyServiceConfig {
        id: args.id,
        shares: args.shares,
        policy: args.policy,
        listen: args.listen,
        tls,
        signing_key: args.signing_key,
        audit_log: args.audit_log,
        audience,
    };
    confed::keyservice::serve::run(config, shutdown_signal()).await?;
    Ok(())
}

async fn devices(command: DevicesCommand) -> Result<()> {
    use confed::device::simulate::{SimulationConfig, initial_model, run};
    match command {
        DevicesCommand::Simulate {
            server,
            population,
            devices,
            concurrency,
            rounds,
            trust,
            no_train,
            seed,
            rows_per_device,
            max_retry_wait_ms,
            idle_limit,
            client_version,
        } => {
            let trust = confed::device::TrustConfig::load(&trust)?;
            let summary = run(SimulationConfig {
                server,
                population,
                devices,
                first_device: 0,
                concurrency,
                rounds,
                trust,
                train: !no_train,
                seed,
                rows_per_device,
                max_retry_wait: Duration::from_millis(max_retry_wait_ms),
                idle_limit,
                client_version,
                progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
                bars: None,
            })
            .await?;
            summary.print();
        }
        DevicesCommand::InitModel { out, seed } => {
            std::fs::write(&out, initial_model(seed))
                .with_context(|| format!("writing {}", out.display()))?;
            println!(
                "wrote {} (softmax regression, 4 classes x 16 features, zeros)",
                out.display()
            );
        }
        DevicesCommand::TrustConfig {
            keyservices,
            threshold,
            max_epsilon,
            max_delta,
            min_reports,
            tenant_id,
        } => {
            let client = confed_enclave::http::client(Duration::from_secs(10));
            let mut entries = Vec::new();
            for url in &keyservices {
                let set: confed_attestation::exchange::KeySet = client
                    .get(format!("{}/v1/keys", url.trim_end_matches('/')))
                    .send()
                    .await
                    .and_then(|r| r.error_for_status())
                    .with_context(|| format!("fetching {url}/v1/keys"))?
                    .json()
                    .await
                    .with_context(|| format!("reading {url}/v1/keys"))?;
                entries.push(confed::device::client::TrustedEntry {
                    id: set.keyservice_id,
                    verifying_key: set.verifying_key,
                });
            }
            let config = confed::device::TrustConfig {
                threshold,
                keyservices: entries,
                limits: confed_enclave::policy::DeviceLimits {
                    max_epsilon,
                    max_delta,
                    min_reports,
                },
                tenant_id,
            };
            println!("{}", serde_json::to_string_pretty(&config)?);
        }
    }
    Ok(())
}
