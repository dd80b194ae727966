//! `confed-issuer` (and `confed issuer`): serve the issuer, or make its signing key
//! (`docs/operations.md`, "Token issuer").

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use clap::{Args, Subcommand, ValueEnum};
use confed_protocol::clock::{Clock as _, SystemClock};
use confed_protocol::privacy_pass::issuance::TokenSigner;
use confed_serving::TlsFiles;

use crate::attester::android::revocation::{StatusFile, StatusList};
use crate::attester::android::{
    AllowedApp, AndroidAttester, AndroidPolicy, google_root_keys, root_keys_from_pem,
};
use crate::attester::apple::registry::Registry;
use crate::attester::apple::{
    AllowedAppId, AppleAttester, ApplePolicy, apple_roots, root_certificates_from_pem,
};
use crate::attester::several::Attesters;
use crate::attester::{Attester, dev::DevAttester};
use crate::limiter::Limiter;
use crate::{Issuer, routes};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AttesterKind {
    /// Self-made P-256 keys: anyone can attest. Tests and demos only; said loudly.
    Dev,
    /// Android key attestation under Google's hardware attestation roots (RKP keys only).
    AndroidKeyAttestation,
    /// Apple App Attest under Apple's App Attestation Root CA (iOS, iPadOS).
    AppleAppAttest,
}

#[derive(Debug, Args)]
pub struct IssuerArgs {
    /// Address to listen on (plain HTTP only on loopback; otherwise pass --tls-cert/--tls-key).
    #[arg(long, default_value = "127.0.0.1:8480")]
    pub listen: SocketAddr,
    /// Serve /metrics and /readyz on this address instead of the API's (plain HTTP unless TLS
    /// files are given): keep the issuer's counts off a public port.
    #[arg(long)]
    pub ops_listen: Option<SocketAddr>,
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The issuer name task policies and token challenges name (1-128 of A-Z a-z 0-9 . _ -).
    #[arg(long)]
    pub name: String,
    /// PKCS#8 PEM RSA-2048 signing key (`confed-issuer generate-key FILE`).
    #[arg(long)]
    pub signing_key: PathBuf,
    /// Another PKCS#8 PEM signing key held beside `--signing-key` during a key rotation (the
    /// next key, before tasks name it, or the previous one while tasks still do); repeat for
    /// several. The directory lists every key held (docs/operations.md, "Rotating a token
    /// issuer's key").
    #[arg(long = "also-signing-key", value_name = "FILE")]
    pub also_signing_keys: Vec<PathBuf>,
    /// Directory of the per-window grant counts (`limiter/`); keep it on durable storage.
    #[arg(long)]
    pub state: PathBuf,
    /// L: tokens one attested device may obtain per window.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub tokens_per_window: u32,
    /// The window's length in seconds (a day by default).
    #[arg(long, default_value_t = 86_400, value_parser = clap::value_parser!(i64).range(60..=31_622_400))]
    pub window_seconds: i64,
    /// How devices prove their integrity; repeat for an app on several platforms (e.g.
    /// `--attester android-key-attestation --attester apple-app-attest`). `dev` stands alone.
    #[arg(long = "attester", value_enum, required = true)]
    pub attesters: Vec<AttesterKind>,
    /// Android: an app whose keys may attest, as its package name and the lowercase hex SHA-256
    /// of its signing certificate (repeat for several apps).
    #[arg(long = "android-app", value_name = "PACKAGE:SHA256HEX")]
    pub android_apps: Vec<AllowedApp>,
    /// Android: the operator's copy of Google's certificate status list
    /// (https://android.googleapis.com/attestation/status), refreshed on a schedule.
    #[arg(long, value_name = "FILE")]
    pub android_status: Option<PathBuf>,
    /// Android: hours after which the status list file counts as stale; the issuer then refuses
    /// attestations (503) until a fresh copy arrives.
    #[arg(long, value_name = "HOURS", default_value_t = 48, value_parser = clap::value_parser!(i64).range(1..=720))]
    pub android_status_max_age_hours: i64,
    /// Android: PEM roots to trust instead of Google's built-in hardware attestation roots.
    #[arg(long, value_name = "FILE")]
    pub android_roots: Option<PathBuf>,
    /// Android: the lowest OS patch level accepted, as YYYYMM.
    #[arg(long, value_name = "YYYYMM", value_parser = clap::value_parser!(i64).range(201_501..=299_912))]
    pub android_min_patch_level: Option<i64>,
    /// Apple: an app whose App Attest keys may attest, by its App ID: the 10-character team id, a
    /// dot, the bundle id (repeat for several apps).
    #[arg(long = "apple-app", value_name = "TEAMID.BUNDLEID")]
    pub apple_apps: Vec<AllowedAppId>,
    /// Apple: PEM roots to trust instead of the built-in Apple App Attestation Root CA.
    #[arg(long, value_name = "FILE")]
    pub apple_roots: Option<PathBuf>,
    /// Apple: also accept keys of development builds (AAGUID `appattestdevelop`, apps signed with
    /// a development profile); leave off in production.
    #[arg(long)]
    pub apple_development: bool,
}

#[derive(Debug, Subcommand)]
pub enum IssuerCommand {
    /// Generate an RSA-2048 signing key into FILE (owner-only) and print its token key.
    GenerateKey { file: PathBuf },
}

fn valid_name(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// Reads the signing key, refusing a file others can read.
pub fn load_signer(path: &Path) -> anyhow::Result<TokenSigner> {
    use std::os::unix::fs::PermissionsExt;
    let metadata =
        std::fs::metadata(path).with_context(|| format!("signing key {}", path.display()))?;
    if metadata.permissions().mode() & 0o077 != 0 {
        anyhow::bail!(
            "signing key {} is readable by others (mode {:o}): chmod 600 it",
            path.display(),
            metadata.permissions().mode() & 0o777
        );
    }
    let pem = zeroize::Zeroizing::new(
        std::fs::read_to_string(path).with_context(|| format!("signing key {}", path.display()))?,
    );
    TokenSigner::from_pem(&pem).with_context(|| format!("signing key {}", path.display()))
}

pub fn generate_key(file: &Path) -> anyhow::Result<String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let signer = TokenSigner::generate()?;
    let pem = signer.to_pem()?;
    let mut out = std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(file)
        .with_context(|| format!("creating {} (it must not exist yet)", file.display()))?;
    out.write_all(pem.as_bytes())
        .and_then(|()| out.sync_all())
        .with_context(|| format!("writing {}", file.display()))?;
    Ok(serde_json::json!({
        "token-type": confed_protocol::privacy_pass::TOKEN_TYPE_BLIND_RSA,
        "token-key": URL_SAFE_NO_PAD.encode(signer.spki()),
        "token_key_id": confed_protocol::hex::encode(signer.issuer_key().token_key_id),
    })
    .to_string())
}

/// Builds the issuer the arguments describe.
pub fn build(args: &IssuerArgs) -> anyhow::Result<Arc<Issuer>> {
    if !valid_name(&args.name) {
        anyhow::bail!("--name must be 1-128 of A-Z a-z 0-9 . _ -");
    }
    let signer = load_signer(&args.signing_key)?;
    let limiter = Limiter::open(&args.state, args.tokens_per_window, args.window_seconds)?;
    let attester = attesters(args, &limiter)?;
    if attester.insecure() {
        tracing::warn!("{}", routes::DEV_ATTESTER_WARNING);
        eprintln!("confed-issuer: {}", routes::DEV_ATTESTER_WARNING);
    }
    let mut issuer = Issuer::new(
        args.name.clone(),
        signer,
        attester,
        limiter,
        args.window_seconds,
        Arc::new(SystemClock),
    )
    .map_err(|e| anyhow::anyhow!("starting the issuer: {e}"))?;
    for path in &args.also_signing_keys {
        issuer = issuer
            .with_key(load_signer(path)?)
            .map_err(|e| anyhow::anyhow!("--also-signing-key {}: {e}", path.display()))?;
    }
    Ok(Arc::new(issuer))
}

/// The attesters `--attester` names, each given only its own options.
fn attesters(args: &IssuerArgs, limiter: &Limiter) -> anyhow::Result<Box<dyn Attester>> {
    let named = |kind| args.attesters.contains(&kind);
    let android_options = !args.android_apps.is_empty()
        || args.android_status.is_some()
        || args.android_roots.is_some()
        || args.android_min_patch_level.is_some();
    if android_options && !named(AttesterKind::AndroidKeyAttestation) {
        anyhow::bail!(
            "the --android-* options configure --attester android-key-attestation; remove them or add that attester"
        );
    }
    let apple_options =
        !args.apple_apps.is_empty() || args.apple_roots.is_some() || args.apple_development;
    if apple_options && !named(AttesterKind::AppleAppAttest) {
        anyhow::bail!(
            "the --apple-* options configure --attester apple-app-attest; remove them or add that attester"
        );
    }
    let mut distinct = args.attesters.clone();
    distinct.sort_by_key(|kind| *kind as u8);
    distinct.dedup();
    if distinct.len() != args.attesters.len() {
        anyhow::bail!("name each --attester once");
    }
    if named(AttesterKind::Dev) {
        if args.attesters.len() > 1 {
            anyhow::bail!(
                "--attester dev lets anyone obtain tokens, so it cannot sit beside a real attester; run it alone"
            );
        }
        return Ok(Box::new(DevAttester));
    }
    let mut parts: Vec<Box<dyn Attester>> = Vec::new();
    for kind in &args.attesters {
        match kind {
            AttesterKind::Dev => {}
            AttesterKind::AndroidKeyAttestation => parts.push(Box::new(android_attester(args)?)),
            AttesterKind::AppleAppAttest => parts.push(Box::new(apple_attester(args, limiter)?)),
        }
    }
    if parts.len() == 1 {
        return Ok(parts.remove(0));
    }
    Attesters::new(parts)
        .map(|several| Box::new(several) as Box<dyn Attester>)
        .context("the attesters must be distinct and none of them dev")
}

fn apple_attester(args: &IssuerArgs, limiter: &Limiter) -> anyhow::Result<AppleAttester> {
    let trusted_roots = match &args.apple_roots {
        Some(path) => root_certificates_from_pem(
            &std::fs::read(path).with_context(|| format!("roots {}", path.display()))?,
        )
        .with_context(|| format!("roots {}", path.display()))?,
        None => apple_roots(),
    };
    if args.apple_development {
        tracing::warn!(
            "--apple-development: keys of development builds attest too; production issuers leave it off"
        );
    }
    let registry = Registry::open(
        &args.state,
        limiter.derived_key(b"confed-issuer-app-attest-registry-key-v1"),
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    tracing::info!(
        apps = args.apple_apps.len(),
        roots = trusted_roots.len(),
        development = args.apple_development,
        "Apple App Attest"
    );
    Ok(AppleAttester::new(
        ApplePolicy {
            trusted_roots,
            apps: args.apple_apps.clone(),
            allow_development: args.apple_development,
        },
        registry,
    )?)
}

/// How old the status list may be before the issuer warns at start (Google updates it within hours).
const STATUS_LIST_WARN_AGE: i64 = 24 * 3600;
/// The longest window the Android attester allows (RKP keys rotate about every two weeks).
const MAX_ANDROID_WINDOW_SECONDS: i64 = 7 * 86_400;

fn android_attester(args: &IssuerArgs) -> anyhow::Result<AndroidAttester> {
    let status_path = args.android_status.as_ref().context(
        "--attester android-key-attestation needs --android-status FILE: fetch https://android.googleapis.com/attestation/status into FILE (and refresh it on a schedule) so revoked attestation keys are refused",
    )?;
    // RKP attestation keys live about two weeks: a longer window would let one key rotate within
    // it several times, each a fresh allowance.
    if args.window_seconds > MAX_ANDROID_WINDOW_SECONDS {
        anyhow::bail!(
            "--window-seconds {} is longer than 7 days: an Android attestation key rotates about every two weeks, so one device could draw several allowances in one window; use a shorter window",
            args.window_seconds
        );
    }
    let status_file = StatusFile::open(status_path, args.android_status_max_age_hours * 3600)
        .map_err(anyhow::Error::msg)?;
    let now = SystemClock.now_seconds();
    if status_file.age(now) > STATUS_LIST_WARN_AGE {
        tracing::warn!(
            file = %status_path.display(),
            "the Android status list is more than a day old: refresh it, or newly revoked attestation keys are still accepted"
        );
    }
    let trusted_roots = match &args.android_roots {
        Some(path) => root_keys_from_pem(
            &std::fs::read(path).with_context(|| format!("roots {}", path.display()))?,
        )
        .with_context(|| format!("roots {}", path.display()))?,
        None => google_root_keys(),
    };
    tracing::info!(
        apps = args.android_apps.len(),
        revoked_serials = status_file.list().len(),
        roots = trusted_roots.len(),
        "Android key attestation"
    );
    Ok(AndroidAttester::new(AndroidPolicy {
        trusted_roots,
        apps: args.android_apps.clone(),
        status_list: StatusList::default(),
        min_os_patch_level: args.android_min_patch_level,
    })?
    .with_status_file(status_file))
}

pub async fn run(
    command: Option<IssuerCommand>,
    args: Option<IssuerArgs>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    match (command, args) {
        (Some(IssuerCommand::GenerateKey { file }), _) => {
            println!("{}", generate_key(&file)?);
            Ok(())
        }
        (None, Some(args)) => {
            let tls = match (&args.tls_cert, &args.tls_key) {
                (Some(cert), Some(key)) => Some(TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                }),
                _ => None,
            };
            confed_serving::check_listen(args.listen, tls.as_ref())?;
            // Anyone can attest to the dev attester, so an issuer running it grants tokens to
            // anyone: it serves this machine only (tests, demos), never a network.
            if args.attesters.contains(&AttesterKind::Dev) && !args.listen.ip().is_loopback() {
                anyhow::bail!(
                    "--attester dev lets anyone obtain tokens, so it listens on loopback only (127.0.0.1 or ::1); a networked issuer needs a real attester"
                );
            }
            let issuer = build(&args)?;
            confed_ops::install(confed_ops::BuildInfo {
                process: "confed-issuer",
                version: env!("CARGO_PKG_VERSION"),
            });
            // The series the shipped alert rules watch exist from the start (at 0).
            metrics::counter!("confed_issuer_tokens_issued_total").absolute(0);
            metrics::counter!("confed_issuer_refusals_total").absolute(0);
            tracing::info!(
                name = issuer.name(),
                tokens_per_window = args.tokens_per_window,
                window_seconds = args.window_seconds,
                "token issuer starting"
            );
            let app = match args.ops_listen {
                None => routes::router(issuer),
                Some(addr) => {
                    let bound = confed_serving::bind_ops_only(addr, tls.as_ref())
                        .await?
                        .quiet();
                    let ops = routes::ops_router(&issuer);
                    tracing::info!(listen = %addr, "serving /metrics, /healthz and /readyz apart from the API");
                    tokio::spawn(async move {
                        if let Err(error) =
                            confed_serving::serve_bound(bound, ops, std::future::pending()).await
                        {
                            tracing::error!(%error, "the operator listener stopped");
                        }
                    });
                    routes::api_router(issuer)
                        .route("/healthz", axum::routing::get(|| async { "ok" }))
                }
            };
            confed_serving::serve_app(args.listen, tls.as_ref(), app, shutdown).await?;
            Ok(())
        }
        (None, None) => anyhow::bail!("pass the issuer's arguments or a subcommand (see --help)"),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: IssuerArgs,
    }

    fn attesters_of(extra: &[&str]) -> anyhow::Result<Vec<&'static str>> {
        let dir = tempfile::tempdir()?;
        let status = dir.path().join("status.json");
        std::fs::write(&status, r#"{"entries": {}}"#)?;
        let state = dir.path().join("state");
        let mut argv = vec![
            "issuer",
            "--name",
            "issuer.test",
            "--signing-key",
            "unused.pem",
            "--state",
            state.to_str().unwrap_or_default(),
        ];
        argv.extend_from_slice(extra);
        let status = format!("--android-status={}", status.display());
        argv.push(&status);
        let mut args = Cli::try_parse_from(argv)?.args;
        if !args
            .attesters
            .contains(&AttesterKind::AndroidKeyAttestation)
        {
            args.android_status = None;
        }
        let limiter = Limiter::open(&args.state, 1, 86_400)?;
        Ok(attesters(&args, &limiter)?.formats())
    }

    #[test]
    fn attesters_combine_for_an_app_on_both_platforms_but_never_with_dev_or_foreign_options() {
        let app = format!("--android-app=com.example.fl:{}", "5a".repeat(32));
        let both = [
            "--attester",
            "android-key-attestation",
            "--attester",
            "apple-app-attest",
            app.as_str(),
            "--apple-app",
            "A1B2C3D4E5.com.example.fl",
        ];
        assert_eq!(
            attesters_of(&both).unwrap(),
            ["android-key-attestation", "apple-app-attest"]
        );
        let apple = [
            "--attester",
            "apple-app-attest",
            "--apple-app",
            "A1B2C3D4E5.com.example.fl",
        ];
        assert_eq!(attesters_of(&apple).unwrap(), ["apple-app-attest"]);
        for (argv, says) in [
            (
                &["--attester", "dev", "--attester", "apple-app-attest"][..],
                "cannot sit beside a real attester",
            ),
            (
                &[
                    "--attester",
                    "dev",
                    "--apple-app",
                    "A1B2C3D4E5.com.example.fl",
                ][..],
                "--apple-* options configure",
            ),
            (&["--attester", "apple-app-attest"][..], "--apple-app"),
            (
                &["--attester", "dev", "--attester", "dev"][..],
                "name each --attester once",
            ),
            (
                &[
                    "--attester",
                    "apple-app-attest",
                    "--apple-app",
                    "com.example.fl",
                ][..],
                "TEAMID.BUNDLEID",
            ),
        ] {
            let error = format!("{:#}", attesters_of(argv).unwrap_err());
            assert!(error.contains(says), "{argv:?}: {error}");
        }
    }
}
