//! `confed verify`: check what a server published against your own trust file.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;

#[derive(Subcommand)]
pub(crate) enum VerifyCommand {
    /// A round's release: the enclave's signature and the receipts of q = max(t, ceil((n + t) /
    /// 2)) key services for its commitment (any two such quorums share t key services, so no
    /// second release of the round can gather q), checked offline against the key services'
    /// verifying keys in the trust file. The tenant token comes from --token-file or CONFED_TOKEN.
    Release {
        /// Base URL of `confed serve` (the release, its proof and the task's policy are read
        /// from it; nothing it says is trusted beyond what the signatures prove).
        #[arg(long)]
        server: String,
        /// The task's id.
        #[arg(long)]
        task: String,
        /// The round whose release to check.
        #[arg(long)]
        round: u64,
        /// Trust file: {"threshold" (t), "keyservices": [{"id", "verifying_key"}] (n of them, or
        /// "shares"), ...}.
        #[arg(long)]
        trust: PathBuf,
        /// A file holding the tenant's API token (else CONFED_TOKEN).
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// The task policy text you expect (e.g. saved from GET /v1/tasks/{id} when you created
        /// the task): the release must name exactly it.
        #[arg(long)]
        policy: Option<PathBuf>,
    },
}

pub(super) async fn run(command: VerifyCommand) -> Result<()> {
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
    let trust = confed_device::load_trust(&trust)?;
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
