//! The one way confed builds HTTP clients: rustls with ring as the process's single crypto
//! provider (installed here if nothing was installed yet), and a timeout on every request.

use std::time::Duration;

/// Installs ring as the process-wide rustls provider unless one is installed already.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// An HTTP client with `timeout` per request.
pub fn client(timeout: Duration) -> reqwest::Client {
    install_crypto_provider();
    reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .expect("an HTTP client with rustls and a ring provider builds")
}
