//! Bearer secrets (admin and worker tokens) from a file or the environment.

use std::path::PathBuf;

use anyhow::{Context, Result};
use confed::auth::AdminToken;

pub(super) fn admin_token(file: Option<&PathBuf>) -> Result<Option<AdminToken>> {
    shared_token(file, "CONFED_ADMIN_TOKEN", "admin")
}

/// A bearer secret from a file, else from the environment variable `env`; `None` with neither.
pub(super) fn shared_token(
    file: Option<&PathBuf>,
    env: &str,
    what: &str,
) -> Result<Option<AdminToken>> {
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
