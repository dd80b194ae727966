//! Serving a router: plain HTTP on loopback only, otherwise TLS (rustls with the operator's
//! certificate and key files), with a graceful drain on shutdown. One small crate, so each
//! operator (front ends, key services, the token issuer) reviews the same code it listens with.

#![forbid(unsafe_code)]

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

pub mod ops;

/// How long in-flight requests may finish after a shutdown signal.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// PEM files of the certificate chain and its private key.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Error)]
pub enum ListenError {
    #[error(
        "refusing to serve plain HTTP on {0}, which is not a loopback address: pass --tls-cert and --tls-key, or listen on 127.0.0.1"
    )]
    PlainHttpOffLoopback(SocketAddr),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot load the TLS certificate or key")]
    Tls(#[source] std::io::Error),
    #[error("server error")]
    Serve(#[source] std::io::Error),
}

/// Plain HTTP is for loopback only: anything else must come with TLS files.
pub fn check_listen(addr: SocketAddr, tls: Option<&TlsFiles>) -> Result<(), ListenError> {
    if tls.is_none() && !addr.ip().is_loopback() {
        return Err(ListenError::PlainHttpOffLoopback(addr));
    }
    Ok(())
}

/// Serves `app` on `listen` until `shutdown` completes. Prints `confed: serving on URL` on
/// stdout, so scripts and tests can read the address (port 0 picks a free one).
pub async fn serve_app(
    listen: SocketAddr,
    tls: Option<&TlsFiles>,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ListenError> {
    let bound = bind_app(listen, tls).await?;
    serve_bound(bound, app, shutdown).await
}

/// A listener bound by `bind_app` or `bind_ops_only`, with its TLS configuration already
/// loaded, not yet serving.
pub struct Bound {
    listener: tokio::net::TcpListener,
    tls: Option<axum_server::tls_rustls::RustlsConfig>,
    /// Print `confed: serving on URL` (the line scripts read the process's address from).
    announce: bool,
}

impl Bound {
    /// A second listener of the process (its operator routes): logged, not announced on stdout,
    /// where the first `confed: serving on` line must stay the API's.
    pub fn quiet(self) -> Self {
        Self {
            announce: false,
            ..self
        }
    }
}

/// Checks the address, loads the TLS files and binds: a process does this before it creates or
/// prints anything, so a busy port or a bad certificate stops a first start before it leaves
/// state behind (or prints a token it will not show again).
pub async fn bind_app(listen: SocketAddr, tls: Option<&TlsFiles>) -> Result<Bound, ListenError> {
    check_listen(listen, tls)?;
    bind(listen, tls).await
}

/// Binds a listener for the operator routes alone (`ops::ops_router`): plain HTTP is allowed on
/// any address there, since they take no input but a path and hold no secret (a scheduler's
/// probes and scrapes come from the cluster network). TLS when given.
pub async fn bind_ops_only(
    listen: SocketAddr,
    tls: Option<&TlsFiles>,
) -> Result<Bound, ListenError> {
    bind(listen, tls).await
}

async fn bind(listen: SocketAddr, tls: Option<&TlsFiles>) -> Result<Bound, ListenError> {
    let tls = match tls {
        Some(files) => {
            confed_protocol::http::install_crypto_provider();
            Some(
                axum_server::tls_rustls::RustlsConfig::from_pem_file(&files.cert, &files.key)
                    .await
                    .map_err(ListenError::Tls)?,
            )
        }
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| ListenError::Listen {
            addr: listen,
            source,
        })?;
    Ok(Bound {
        listener,
        tls,
        announce: true,
    })
}

/// Serves `app` on a bound listener until `shutdown` completes (see `serve_app`).
pub async fn serve_bound(
    Bound {
        listener,
        tls,
        announce,
    }: Bound,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ListenError> {
    let local = listener.local_addr().map_err(ListenError::Serve)?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    if announce {
        println!("confed: serving on {scheme}://{local}");
    }
    tracing::info!(%local, scheme, "serving");
    match tls {
        None => axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(ListenError::Serve),
        Some(config) => serve_tls(listener, app, config, shutdown).await,
    }
}

async fn serve_tls(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    config: axum_server::tls_rustls::RustlsConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ListenError> {
    let handle = axum_server::Handle::new();
    let drain = handle.clone();
    tokio::spawn(async move {
        shutdown.await;
        drain.graceful_shutdown(Some(DRAIN_TIMEOUT));
    });
    let listener = listener.into_std().map_err(ListenError::Serve)?;
    axum_server::from_tcp_rustls(listener, config)
        .map_err(ListenError::Serve)?
        .handle(handle)
        .serve(app.into_make_service())
        .await
        .map_err(ListenError::Serve)
}

/// Completes on SIGINT or SIGTERM. The handlers are installed when this is called, not when the
/// future is first polled: a process that announced itself may be signalled at once (a
/// supervisor, a test), and a signal before the handler exists would kill it uncleanly. Call it
/// inside the runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt()).expect("installing the SIGINT handler");
    let mut terminate = signal(SignalKind::terminate()).expect("installing the SIGTERM handler");
    async move {
        tokio::select! {
            _ = interrupt.recv() => {},
            _ = terminate.recv() => {},
        }
        tracing::info!("shutdown signal received; draining");
    }
}
