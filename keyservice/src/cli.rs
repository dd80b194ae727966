//! The key service's command line, shared by the `confed-keyservice` binary and the
//! `confed keyservice` command: run one key service, or verify its audit log.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};

use confed_serving::TlsFiles;

#[derive(Subcommand)]
pub enum KeyserviceCommand {
    /// Hash-chained audit log tools.
    Audit {
        #[command(subcommand)]
        command: AuditCommand,
    },
    /// Create the key service's signing key if missing (PKCS#8 PEM, mode 0600) and print its
    /// verifying key, as peers files and device trust files pin it.
    SigningKey { file: PathBuf },
}

#[derive(Subcommand)]
pub enum AuditCommand {
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
    /// Accept that the log lost records up to a head (named by the key service's refusal: a log
    /// behind its own checkpoint, or behind what a peer witnessed), with the service stopped.
    /// Appends a signed `loss_acknowledged` record; the release ledger forgets the lost rounds.
    AcknowledgeLoss {
        file: PathBuf,
        #[arg(long)]
        id: String,
        /// The key service's signing key file (PKCS#8 PEM).
        #[arg(long)]
        signing_key: PathBuf,
        /// The lost head's record count, as the refusal names it.
        #[arg(long)]
        records: u64,
        /// The lost head's hash, as the refusal names it.
        #[arg(long)]
        hash: String,
        /// The lost head's signature, as the refusal names it (only a head this service
        /// signed is accepted).
        #[arg(long)]
        signature: String,
        /// Why the loss is accepted (kept in the record).
        #[arg(long)]
        note: String,
    },
}

#[derive(Args)]
pub struct KeyserviceArgs {
    /// This key service's id (1-64 of A-Z a-z 0-9 . _ -), bound into signatures and releases.
    #[arg(long)]
    pub id: String,
    /// Share files this service holds (one per key).
    #[arg(long = "share", required = true)]
    pub shares: Vec<PathBuf>,
    /// Appraisal policy (TOML), e.g. policies/confidential-space.toml.
    #[arg(long)]
    pub policy: PathBuf,
    #[arg(long, default_value = "127.0.0.1:8090")]
    pub listen: SocketAddr,
    /// Serve /metrics and /readyz on this address instead of the API's (plain HTTP unless TLS
    /// files are given): keep the service's counts off a public port.
    #[arg(long)]
    pub ops_listen: Option<SocketAddr>,
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// P-256 key that signs the key set (PKCS#8 PEM); created if missing.
    #[arg(long)]
    pub signing_key: PathBuf,
    /// Append-only, hash-chained decision log.
    #[arg(long)]
    pub audit_log: PathBuf,
    /// X25519 key devices seal mask seeds to (base64url, mode 0600); created if missing. Without
    /// it this service takes no part in masked tasks (docs/secure-aggregation.md).
    #[arg(long)]
    pub masking_key: Option<PathBuf>,
    /// The `aud` tokens must carry; default `confed-keyservice/<id>`.
    #[arg(long)]
    pub audience: Option<String>,
    /// The other key services (JSON: {"peers": [{"id", "url", "verifying_key"}]}): each
    /// witnesses this one's audit head and is witnessed by it; after a start this service
    /// grants only once a quorum of them said its log is not behind (docs/attestation.md).
    #[arg(long)]
    pub peers: Option<PathBuf>,
    /// Peers that must answer after a start before this service grants; default ceil(peers/2).
    #[arg(long, requires = "peers")]
    pub witness_quorum: Option<usize>,
    /// Seconds between pulls of the peers' heads (pushes follow every record at once).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub witness_pull_seconds: u64,
}

fn audit_verify(
    file: &std::path::Path,
    id: &str,
    verifying_key: Option<&str>,
    signing_key: Option<&std::path::Path>,
) -> Result<()> {
    use crate::audit::{SignatureCheck, verify_file_signed};
    let key = match (verifying_key, signing_key) {
        (Some(text), _) => confed_attestation::exchange::decode_verifying_key(text)
            .context("--verifying-key is not a base64url SEC1 P-256 point")?,
        (None, Some(path)) => *crate::load_existing_signing_key(path)?.verifying_key(),
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

/// `confed keyservice ...` and `confed-keyservice ...`: run a key service until `shutdown`, or
/// check an audit log.
pub async fn run(
    command: Option<KeyserviceCommand>,
    run: Option<KeyserviceArgs>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
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
    if let Some(KeyserviceCommand::Audit {
        command:
            AuditCommand::AcknowledgeLoss {
                file,
                id,
                signing_key,
                records,
                hash,
                signature,
                note,
            },
    }) = command
    {
        let key = std::sync::Arc::new(crate::load_existing_signing_key(&signing_key)?);
        let _lock = crate::serve::lock_log(&file)?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        let lost = crate::audit::LostHead { records, hash };
        let record =
            crate::acknowledge::acknowledge_loss(&file, &id, key, lost, &signature, &note, now)?;
        println!(
            "loss acknowledged in record {} (head {}); start the key service again",
            record.seq, record.hash
        );
        return Ok(());
    }
    if let Some(KeyserviceCommand::SigningKey { file }) = command {
        let key = crate::load_or_create_signing_key(&file)?;
        println!(
            "{}",
            confed_attestation::exchange::encode_verifying_key(key.verifying_key())
        );
        return Ok(());
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
    let config = crate::serve::KeyServiceConfig {
        id: args.id,
        shares: args.shares,
        policy: args.policy,
        listen: args.listen,
        tls,
        signing_key: args.signing_key,
        audit_log: args.audit_log,
        masking_key: args.masking_key,
        audience,
        peers: args.peers,
        witness_quorum: args.witness_quorum,
        witness_pull: std::time::Duration::from_secs(args.witness_pull_seconds),
        ops_listen: args.ops_listen,
    };
    crate::serve::run(config, shutdown).await?;
    Ok(())
}

pub use confed_serving::shutdown_signal;

/// Whatever a key service writes (its audit log, signing key, checkpoints) is for its operator
/// only (`docs/operations.md`).
pub fn owner_only_files() {
    // SAFETY: umask only sets the process's file-creation mask; it cannot fail.
    unsafe { libc::umask(0o077) };
}
