//! `confed keys`: the key generation ceremony.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;
use confed::clock::{Clock, SystemClock, rfc3339};

#[derive(Subcommand)]
pub(crate) enum KeysCommand {
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

pub(super) fn parse_time(text: Option<&str>, default: i64) -> Result<i64> {
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

pub(super) fn run(command: KeysCommand) -> Result<()> {
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
            let now = SystemClock.now_seconds().0;
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
                rfc3339(confed::clock::Seconds(not_before).millis()),
                rfc3339(confed::clock::Seconds(not_after).millis())
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
