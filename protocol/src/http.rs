//! The one way confed builds HTTP clients: rustls with ring as the process's single crypto
//! provider (installed here if nothing was installed yet), and a timeout on every request (or,
//! for a streamed answer, on every wait for the server).

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

/// An HTTP client for long streamed answers: `connect` bounds connecting, and nothing bounds the
/// whole exchange (its reader may take its time to consume the body); the caller bounds each
/// wait for the server instead.
pub fn streaming_client(connect: Duration) -> reqwest::Client {
    install_crypto_provider();
    reqwest::Client::builder()
        .connect_timeout(connect)
        .build()
        .expect("an HTTP client with rustls and a ring provider builds")
}
