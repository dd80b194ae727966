//! A token issuer as the tools (the simulator, the demo) trust it: its directory fetched from its
//! URL. Whatever answers is trusted, which is right for a simulation and a demo only; a real
//! device's trust file lists the issuer's keys as its operator published them.

use confed_protocol::privacy_pass::issuer_api::Directory;
use confed_protocol::trust::TrustedIssuer;

/// The issuer at `url` (its base URL), from its directory. Prints the issuer's warning (a dev
/// attester) to stderr.
pub async fn trusted_issuer(url: &str) -> Result<TrustedIssuer, String> {
    let base = url.trim_end_matches('/');
    if !base.starts_with("http://") && !base.starts_with("https://") {
        return Err(format!(
            "the issuer URL {url:?} must start with http:// or https://"
        ));
    }
    let directory: Directory = confed_protocol::http::client(std::time::Duration::from_secs(10))
        .get(format!("{base}/v1/directory"))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(|e| format!("fetching {base}/v1/directory: {e}"))?
        .json()
        .await
        .map_err(|e| format!("{base}/v1/directory is not an issuer directory: {e}"))?;
    if let Some(warning) = &directory.warning {
        tracing::warn!(issuer = %directory.issuer_name, "{warning}");
    }
    Ok(TrustedIssuer {
        name: directory.issuer_name,
        token_keys: directory
            .token_keys
            .into_iter()
            .map(|k| k.token_key)
            .collect(),
        url: base.to_string(),
    })
}
