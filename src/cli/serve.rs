//! `confed serve`: the front ends, scheduler and (embedded) enclave worker and key services.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use confed::app::Limits;
use confed::server::{self, ServeConfig, TlsFiles};

use super::shutdown_signal;
use super::tokens::{admin_token, shared_token};

#[derive(Args)]
pub(crate) struct DataDir {
    /// Directory holding the task database (unless --database), blobs and contributions.
    #[arg(long, default_value = "./confed-data")]
    pub data_dir: PathBuf,
    /// Task database on PostgreSQL (`postgres://user@host:port/db`) instead of the data
    /// directory's SQLite file.
    #[arg(long, env = "CONFED_DATABASE_URL")]
    pub database: Option<String>,
}

/// Longest retention: ten years, in minutes (a larger value would overflow a duration in
/// seconds long before it meant anything).
const MAX_RETENTION_MINUTES: u64 = 10 * 366 * 24 * 60;

#[derive(Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    pub data: DataDir,
    /// Blobs and device contributions in Google Cloud Storage (`gs://bucket/prefix`) instead of
    /// the data directory; devices then upload through signed URLs. Credentials come from the
    /// environment (Application Default Credentials; the metadata server on GCP).
    #[arg(long, env = "CONFED_BLOBS")]
    pub blobs: Option<String>,
    /// A GCS endpoint other than Google's: only an emulator on plain http:// at a loopback
    /// address (tests, deploy/local).
    #[arg(long, env = "CONFED_GCS_ENDPOINT", requires = "blobs")]
    pub gcs_endpoint: Option<String>,
    /// A service account key (JSON) that signs device upload URLs locally, instead of IAM
    /// signBlob as the ambient identity (one network call per check-in).
    #[arg(long, env = "CONFED_GCS_SIGNING_KEY_FILE", requires = "blobs")]
    pub gcs_signing_key_file: Option<PathBuf>,
    /// Address to listen on (default 127.0.0.1:8080; without the api role, which then serves
    /// only /metrics, /healthz and /readyz, 127.0.0.1:9464); the API's plain HTTP only on
    /// loopback addresses.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// PEM certificate chain for TLS (with --tls-key).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for TLS (with --tls-cert).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// File holding the admin token (else the CONFED_ADMIN_TOKEN environment variable; with
    /// neither, the admin API is off).
    #[arg(long)]
    pub admin_token_file: Option<PathBuf>,
    /// File holding the token `confed-enclave` worker processes present (else the
    /// CONFED_WORKER_TOKEN environment variable; with neither, the worker API is off).
    #[arg(long)]
    pub worker_token_file: Option<PathBuf>,
    /// Largest model upload in bytes.
    #[arg(long, default_value_t = Limits::default().model_bytes)]
    pub max_model_bytes: usize,
    /// Base URL of a key service whose signed key set devices receive (repeat for each).
    #[arg(long = "keyservice")]
    pub keyservices: Vec<String>,
    /// Without --keyservice: the loopback ports the 3 embedded key services listen on, as
    /// START-END (the first free ones, in order; default: any free ports), to keep a demo or
    /// a test inside ports a firewall or a harness allows. Ignored with --keyservice (so the
    /// environment variable may stay set for both layouts).
    #[arg(long, env = "CONFED_EMBEDDED_PORTS")]
    pub embedded_ports: Option<confed::ports::PortRange>,
    /// What this process does (repeat for several; default all three, or api and scheduler
    /// with --keyservice). API replicas,
    /// schedulers and workers can run apart on one PostgreSQL database (`--database`).
    #[arg(long = "role", value_enum)]
    pub roles: Vec<server::Role>,
    /// Seconds between scheduler passes (round deadlines).
    #[arg(long, default_value_t = 1)]
    pub scheduler_period_seconds: u64,
    /// Minutes a closed round's contributions are kept before retention deletes them (default
    /// one week; 1 to ten years).
    #[arg(long, default_value_t = 10080, value_parser = clap::value_parser!(u64).range(1..=MAX_RETENTION_MINUTES))]
    pub retention_minutes: u64,
    /// Which fitting task a checking-in device serves first: fair-share (the least-filled
    /// round), fcfs (the oldest task) or shortest-remaining-demand (docs/operations.md).
    #[arg(
        long,
        value_enum,
        env = "CONFED_SCHEDULING",
        default_value = "fair-share"
    )]
    pub scheduling: confed::scheduling::SchedulingPolicy,
    /// Enclave workers the deployment runs for partitioned rounds: a round of at least twice
    /// --partition-min-contributions is cut into up to this many partitions, each aggregated by
    /// any worker, then merged (docs/architecture.md, "Partitioned rounds"). 1: never.
    #[arg(long, env = "CONFED_PARTITION_WORKERS", default_value_t = confed::aggregation::partitions::PartitionPolicy::default().workers)]
    pub partition_workers: u32,
    /// Fewest contributions a partition sums.
    #[arg(long, default_value_t = confed::aggregation::partitions::PartitionPolicy::default().min_contributions)]
    pub partition_min_contributions: usize,
}

pub(super) async fn run(args: ServeArgs) -> Result<()> {
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
    let default_port = if roles.contains(&server::Role::Api) {
        8080
    } else {
        9464
    };
    let listen = args
        .listen
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], default_port)));
    let config = ServeConfig {
        roles,
        blobs,
        data_dir: args.data.data_dir,
        database: args.data.database,
        keyservices: args.keyservices,
        listen,
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
        // In range (clap checks 1..=MAX_RETENTION_MINUTES), so the product fits.
        retention: Duration::from_secs(args.retention_minutes * 60),
        scheduling: args.scheduling,
        partitioning: confed::aggregation::partitions::PartitionPolicy {
            workers: args.partition_workers.max(1),
            min_contributions: args.partition_min_contributions.max(1),
        },
        embedded_ports: args.embedded_ports,
    };
    server::serve(config, shutdown_signal()).await?;
    Ok(())
}
