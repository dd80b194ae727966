//! `confed-enclave`: the enclave worker as its own process, the TEE image's only program. It
//! leases aggregation jobs from the untrusted server's worker API, attests to the key services,
//! aggregates with DP, and commits releases and models back through the same API.
//!
//! Privacy-relevant limits (maximum epsilon and delta, the noise mechanism) are compiled in, so
//! they are part of the image digest the key services' policies allow-list; the command line
//! (or, in Confidential Space, where the command cannot be overridden, the environment:
//! CONFED_SERVER, CONFED_KEYSERVICES, CONFED_THRESHOLD, CONFED_WORKER_TOKEN_SECRET) only says
//! where things are. The worker token itself comes from Secret Manager there (`secret.rs`): launch
//! variables end up in the attestation token every key service receives.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use confed_attestation::{Attester, ConfidentialSpaceAttester, DevAttester};
use confed_enclave::key_collection::KeyServiceEndpoint;
use confed_enclave::remote::HttpJobStore;
use confed_enclave::worker::{Worker, WorkerConfig};
use zeroize::Zeroizing;

/// How long a lease may wait on the server for a job to appear (long polling).
const LEASE_WAIT_SECONDS: u64 = 20;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum AttesterKind {
    /// Google Confidential Space: tokens from the launcher's socket.
    ConfidentialSpace,
    /// DEVELOPMENT ONLY: tokens signed by a local key that only the dev policy trusts.
    Dev,
}

#[derive(Parser)]
#[command(
    name = "confed-enclave",
    version,
    about = "The confed enclave worker (TEE workload)"
)]
struct Args {
    /// Base URL of the confed server's worker API.
    #[arg(long, env = "CONFED_SERVER")]
    server: String,
    /// File holding the worker token (else --worker-token-secret, else CONFED_WORKER_TOKEN).
    #[arg(long)]
    worker_token_file: Option<PathBuf>,
    /// Secret Manager secret version holding the worker token
    /// (`projects/P/secrets/S/versions/V`), read with the VM's service account: how the token
    /// reaches an enclave in Confidential Space.
    #[arg(long, env = "CONFED_WORKER_TOKEN_SECRET")]
    worker_token_secret: Option<String>,
    /// A key service as ID=URL (repeat for each; or CONFED_KEYSERVICES, comma-separated).
    #[arg(
        long = "keyservice",
        env = "CONFED_KEYSERVICES",
        value_delimiter = ',',
        required = true,
        value_parser = parse_keyservice
    )]
    keyservices: Vec<KeyServiceEndpoint>,
    /// Shares needed to reconstruct a key.
    #[arg(long, env = "CONFED_THRESHOLD")]
    threshold: u16,
    #[arg(long, value_enum, default_value = "confidential-space")]
    attester: AttesterKind,
    /// The Confidential Space launcher's socket.
    #[arg(long, default_value = "/run/container_launcher/teeserver.sock")]
    launcher_socket: PathBuf,
    /// Dev attester signing key (PKCS#8 PEM), created if missing; its public key set is written
    /// next to it as `<file>.jwks.json` for the dev policy's `jwks_file`.
    #[arg(long)]
    dev_key: Option<PathBuf>,
    /// This worker's stable name in leases (default: the host name); a per-process incarnation is
    /// appended (`name/incarnation`), so a restart takes its own jobs back at once.
    #[arg(long)]
    id: Option<String>,
    #[arg(long, default_value_t = 60)]
    lease_seconds: u64,
    /// MiB of a round's contributions kept in memory from the first read, which only those the
    /// job lists without a digest (direct uploads to the blob store) get (it digests them before
    /// the key is asked for); beyond this, the rest are read a second time.
    #[arg(long, default_value_t = (confed_enclave::worker::REMOTE_RETAIN_BYTES >> 20) as u64)]
    retain_mib: u64,
    /// At most MiB of contributions held in memory while the round's key is fetched (the open
    /// step's reads start with the key request), in addition to --retain-mib, plus one
    /// contribution and up to two batches of 32 in flight; each is still checked against its
    /// committed digest when opened. 0 starts the reads after the key.
    #[arg(long, default_value_t = (confed_enclave::worker::REMOTE_READ_AHEAD_BYTES >> 20) as u64)]
    read_ahead_mib: u64,
    /// Process at most one job, then exit (0 whether or not one was ready).
    #[arg(long)]
    once: bool,
    /// Where to serve /metrics, /healthz and /readyz (plain HTTP; they take no input and hold
    /// no secret). The Confidential Space image fixes 0.0.0.0:9464 in its entrypoint.
    #[arg(long, default_value = "127.0.0.1:9464")]
    ops_listen: std::net::SocketAddr,
}

/// What `/readyz` says: whether the last lease attempt reached the server's worker API.
#[derive(Clone, Default)]
struct Contact(Arc<std::sync::Mutex<Option<String>>>);

impl Contact {
    fn reached(&self) {
        if let Ok(mut last) = self.0.lock() {
            *last = None;
        }
    }

    fn failed(&self, why: String) {
        if let Ok(mut last) = self.0.lock() {
            *last = Some(why);
        }
    }

    fn readiness(&self) -> confed_ops::Readiness {
        let contact = self.clone();
        Arc::new(move || {
            let state = contact.0.lock().map_or_else(
                |_| Err("the readiness state is poisoned".to_string()),
                |last| last.as_ref().map_or(Ok(()), |why| Err(why.clone())),
            );
            Box::pin(async move { state })
        })
    }
}

fn parse_keyservice(text: &str) -> Result<KeyServiceEndpoint, String> {
    let (id, url) = text
        .split_once('=')
        .ok_or_else(|| format!("`{text}` is not ID=URL"))?;
    if id.is_empty() || !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(format!("`{text}` is not ID=URL with an http(s) URL"));
    }
    Ok(KeyServiceEndpoint {
        id: id.to_string(),
        url: url.to_string(),
    })
}

async fn worker_token(file: Option<&Path>, secret: Option<&str>) -> Result<Zeroizing<String>> {
    let token = match (file, secret) {
        (Some(path), _) => Zeroizing::new(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the worker token file {}", path.display()))?,
        ),
        (None, Some(name)) => {
            let http = confed_enclave::http::client(Duration::from_secs(30));
            confed_enclave::secret::SecretManager::google(http)
                .access(name)
                .await
                .with_context(|| format!("reading the worker token from Secret Manager ({name})"))?
        }
        (None, None) => Zeroizing::new(std::env::var("CONFED_WORKER_TOKEN").unwrap_or_default()),
    };
    let token = Zeroizing::new(token.trim().to_string());
    if token.is_empty() {
        bail!(
            "no worker token: pass --worker-token-file, --worker-token-secret (CONFED_WORKER_TOKEN_SECRET) or set CONFED_WORKER_TOKEN"
        );
    }
    Ok(token)
}

/// The host's name (in Confidential Space, the VM instance's), else `confed-enclave`.
fn default_worker_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host: String = host
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || "._-".contains(*c))
        .take(64)
        .collect();
    if host.is_empty() {
        "confed-enclave".into()
    } else {
        host
    }
}

fn random_incarnation() -> Result<String> {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("no random bytes: {e}"))?;
    Ok(confed_protocol::hex::encode(bytes))
}

fn dev_attester(path: &Path) -> Result<DevAttester> {
    let clock = Arc::new(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or_default()
    });
    DevAttester::from_key_file(path, clock).map_err(|e| anyhow::anyhow!(e))
}

async fn run(args: Args) -> Result<()> {
    let token = worker_token(
        args.worker_token_file.as_deref(),
        args.worker_token_secret.as_deref(),
    )
    .await?;
    let attester: Arc<dyn Attester> = match args.attester {
        AttesterKind::ConfidentialSpace => {
            Arc::new(ConfidentialSpaceAttester::new(&args.launcher_socket))
        }
        AttesterKind::Dev => {
            let path = args
                .dev_key
                .as_deref()
                .context("--attester dev needs --dev-key FILE")?;
            Arc::new(dev_attester(path)?)
        }
    };
    // Once the configuration is read (its errors come first), and before the first lease: a
    // busy port stops the start instead of leaving a worker nobody can probe.
    let ops = confed_ops::bind_ops(args.ops_listen).await?;
    confed_ops::install(confed_ops::BuildInfo {
        process: "confed-enclave",
        version: env!("CARGO_PKG_VERSION"),
    });
    for outcome in ["released", "partition", "failed", "unreachable"] {
        metrics::counter!("confed_enclave_jobs_total", "outcome" => outcome).absolute(0);
    }
    let contact = Contact::default();
    contact.failed("no lease attempted yet".into());
    tracing::info!(listen = %args.ops_listen, "serving /metrics, /healthz and /readyz");
    tokio::spawn(confed_ops::serve_ops(
        ops,
        "enclave",
        contact.readiness(),
        std::future::pending(),
    ));
    // `name/incarnation`: the name is stable (given, or the host's), the incarnation new in every
    // process, so a restarted worker takes back at once a job its previous process held.
    let name = args.id.unwrap_or_else(default_worker_name);
    let id = format!("{name}/{}", random_incarnation()?);
    // Leases long-poll (up to 20 s): a round the server closes is picked up at once.
    let store = HttpJobStore::new(&args.server, token, Duration::from_secs(120))
        .with_lease_wait(Duration::from_secs(LEASE_WAIT_SECONDS));
    let worker = Worker::new(
        Arc::new(store),
        WorkerConfig {
            id: id.clone(),
            lease: Duration::from_secs(args.lease_seconds.clamp(10, 3600)),
            key_services: args.keyservices,
            threshold: args.threshold,
            attester,
            key_timeout: Duration::from_secs(10),
            batch: 256,
            batch_bytes: 16 << 20,
        },
    )
    .retain_bytes(usize::try_from(args.retain_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX))
    .read_ahead_bytes(
        usize::try_from(args.read_ahead_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX),
    );
    tracing::info!(worker = %id, server = %args.server, "enclave worker started");
    loop {
        // How long to pause before the next lease: none after a job; little after an empty
        // lease (it already waited on the server); a second after a failure.
        let pause = tokio::select! {
            outcome = worker.run_once() => match outcome {
                Ok(Some(done)) => {
                    contact.reached();
                    metrics::counter!("confed_enclave_jobs_total", "outcome" => done.step()).increment(1);
                    metrics::histogram!("confed_enclave_job_seconds")
                        .record(done.phases.after_lease().as_secs_f64());
                    match done.partition {
                        Some((index, count)) => tracing::info!(task = %done.task_id, round = done.round,
                            partition = index, partitions = count,
                            seconds = done.phases.after_lease().as_secs_f64(), phases = %done.phases, "partition sealed"),
                        None => tracing::info!(task = %done.task_id, round = done.round, included = done.included,
                            excluded = done.excluded, epsilon_spent = ?done.epsilon_spent,
                            seconds = done.phases.after_lease().as_secs_f64(), phases = %done.phases, "round released"),
                    }
                    Duration::ZERO
                }
                Ok(None) => {
                    contact.reached();
                    Duration::from_millis(200)
                }
                Err(error) => {
                    // A store backend error is the worker API out of reach (at the lease, or
                    // mid-job); any other (a refused release, a lost lease, a job that failed)
                    // came after the server answered.
                    let outcome = match &error {
                        confed_enclave::worker::JobError::Store(
                            confed_worker_api::store::StoreError::Backend(why),
                        ) => {
                            contact.failed(format!("the worker API did not serve the call: {why}"));
                            "unreachable"
                        }
                        _ => {
                            contact.reached();
                            "failed"
                        }
                    };
                    metrics::counter!("confed_enclave_jobs_total", "outcome" => outcome).increment(1);
                    tracing::warn!(%error, "job not finished; it will be retried");
                    Duration::from_secs(1)
                }
            },
            _ = tokio::signal::ctrl_c() => {
                tracing::info!("interrupted; a leased job is taken over when its lease expires");
                return Ok(());
            }
        };
        if args.once {
            return Ok(());
        }
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
    }
}

fn main() {
    // Text on a terminal (colour only there: the log files and Cloud Logging get none) or JSON
    // lines (CONFED_LOG_FORMAT=json).
    if let Err(error) = confed_ops::init_logs("info") {
        eprintln!("error: {error}");
        std::process::exit(2);
    }
    confed_enclave::http::install_crypto_provider();
    let args = Args::parse();
    let result = tokio::runtime::Runtime::new()
        .context("starting the async runtime")
        .and_then(|runtime| runtime.block_on(run(args)));
    if let Err(error) = result {
        eprintln!("error: {error:#}");
        std::process::exit(1);
    }
}
