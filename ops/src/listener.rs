//! `/metrics`, `/healthz` and `/readyz` on a listener of their own, for a process that serves no
//! HTTP otherwise (an enclave worker). Plain HTTP: it takes no input but a path and holds no
//! secret (docs/operations.md, "Every process's metrics and probes"); keep its port inside the
//! cluster's network. Processes with an HTTP API serve the same three routes on it.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ALLOW, CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use thiserror::Error;
use tokio::net::TcpListener;

/// Whether the process can do its work now: `Err` says why not (answered 503 on `/readyz`).
pub type Readiness =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

/// The content type of Prometheus's text format.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4";
/// What `/readyz` asks a load balancer or kubelet to wait before asking again.
const NOT_READY_RETRY_SECONDS: u32 = 5;
/// A client that has not sent its request head by then is dropped.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection's whole life, answer included: one that does not read its answer is dropped.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections served at once; more are closed at once. A scraper and two probes need three.
const MAX_CONNECTIONS: usize = 32;
/// Largest request head read: the three routes need a request line and a few headers.
const MAX_HEAD_BYTES: usize = 8 * 1024;

#[derive(Debug, Error)]
pub enum ListenerError {
    #[error("cannot listen on {addr} for /metrics, /healthz and /readyz: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Binds the ops listener (before the process does anything else, so a busy port stops the
/// start instead of leaving a process nobody can probe).
pub async fn bind_ops(addr: SocketAddr) -> Result<TcpListener, ListenerError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ListenerError::Bind { addr, source })
}

/// Serves the three routes on `listener` until `shutdown` completes; `role` labels
/// `confed_ready`. The listener can hold no more than `MAX_CONNECTIONS` connections of
/// `MAX_HEAD_BYTES` each for at most `CONNECTION_TIMEOUT`, one request each: in an enclave image
/// it must not be a way to exhaust memory or file descriptors.
pub async fn serve_ops(
    listener: TcpListener,
    role: &'static str,
    readiness: Readiness,
    shutdown: impl Future<Output = ()> + Send,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of file descriptors, typically: wait a moment instead of spinning.
                tracing::warn!(%error, "ops listener: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            // Full: closing is the answer (dropping the stream).
            continue;
        };
        let readiness = readiness.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |request| {
                let readiness = readiness.clone();
                async move { Ok::<_, Infallible>(answer(&request, role, &readiness).await) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .keep_alive(false)
                .max_buf_size(MAX_HEAD_BYTES)
                .serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(CONNECTION_TIMEOUT, connection).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    tracing::debug!(%error, "ops listener: connection ended with an error");
                }
                Err(_) => tracing::debug!("ops listener: connection outlived its time; closed"),
            }
        });
    }
}

async fn answer(
    request: &Request<Incoming>,
    role: &'static str,
    readiness: &Readiness,
) -> Response<Full<Bytes>> {
    let path = request.uri().path();
    if !matches!(*request.method(), Method::GET | Method::HEAD) {
        let mut response = problem(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!(
                "{} {path}: this listener answers GET and HEAD only",
                request.method()
            ),
        );
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    match path {
        "/metrics" => {
            crate::metrics::record_readiness(role, &readiness().await);
            text(
                StatusCode::OK,
                METRICS_CONTENT_TYPE,
                crate::metrics::render(),
            )
        }
        "/healthz" => text(StatusCode::OK, "text/plain; charset=utf-8", "ok".into()),
        "/readyz" => match readiness().await {
            Ok(()) => text(StatusCode::OK, "text/plain; charset=utf-8", "ready".into()),
            Err(why) => {
                let mut response = problem(StatusCode::SERVICE_UNAVAILABLE, &why);
                response
                    .headers_mut()
                    .insert(RETRY_AFTER, HeaderValue::from(NOT_READY_RETRY_SECONDS));
                response
            }
        },
        _ => problem(
            StatusCode::NOT_FOUND,
            &format!("no route {path}: this listener serves /metrics, /healthz and /readyz"),
        ),
    }
}

fn text(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// An RFC 9457 problem, like every other confed error answer.
fn problem(status: StatusCode, detail: &str) -> Response<Full<Bytes>> {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    text(status, "application/problem+json", body.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(addr: SocketAddr, request_line: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("{request_line} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await.unwrap();
        reply
    }

    #[tokio::test]
    async fn the_listener_answers_probes_and_metrics_and_refuses_anything_else() {
        let ready = Arc::new(AtomicBool::new(false));
        let flag = ready.clone();
        let readiness: Readiness = Arc::new(move || {
            let ready = flag.load(Ordering::SeqCst);
            Box::pin(async move {
                if ready {
                    Ok(())
                } else {
                    Err("no job store answered yet".to_string())
                }
            })
        });
        let listener = bind_ops("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_ops(listener, "test", readiness, async {
            let _ = stopped.await;
        }));

        let health = get(addr, "GET /healthz").await;
        assert!(health.starts_with("HTTP/1.1 200"), "{health}");
        let not_ready = get(addr, "GET /readyz").await;
        assert!(not_ready.starts_with("HTTP/1.1 503"), "{not_ready}");
        assert!(not_ready.contains("retry-after: 5"), "{not_ready}");
        assert!(
            not_ready.contains(r#""detail":"no job store answered yet""#),
            "{not_ready}"
        );
        ready.store(true, Ordering::SeqCst);
        assert!(get(addr, "GET /readyz").await.starts_with("HTTP/1.1 200"));
        let metrics = get(addr, "GET /metrics").await;
        assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
        assert!(
            metrics.contains("content-type: text/plain; version=0.0.4"),
            "{metrics}"
        );
        let unknown = get(addr, "GET /v1/jobs").await;
        assert!(unknown.starts_with("HTTP/1.1 404"), "{unknown}");
        assert!(unknown.contains("application/problem+json"), "{unknown}");
        let post = get(addr, "POST /metrics").await;
        assert!(
            post.starts_with("HTTP/1.1 405") && post.contains("allow: GET, HEAD"),
            "{post}"
        );
        let huge = format!(
            "GET /healthz HTTP/1.1\r\nx-filler: {}\r\n\r\n",
            "a".repeat(64 * 1024)
        );
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _ = stream.write_all(huge.as_bytes()).await;
        let mut reply = String::new();
        let _ = stream.read_to_string(&mut reply).await;
        assert!(
            !reply.starts_with("HTTP/1.1 200"),
            "a 64 KiB head is not read: {reply}"
        );

        stop.send(()).unwrap();
        server.await.unwrap();
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "the listener closed at shutdown"
        );
    }

    #[tokio::test]
    async fn idle_connections_beyond_the_cap_are_closed_and_probes_still_answer_after() {
        let readiness: Readiness = Arc::new(|| Box::pin(async { Ok(()) }));
        let listener = bind_ops("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve_ops(
            listener,
            "test",
            readiness,
            std::future::pending(),
        ));
        // Hold every slot with connections that never send a request.
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        // Let the listener accept them all before the next one.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut extra = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut buffer = [0u8; 16];
        let read = tokio::time::timeout(Duration::from_secs(5), extra.read(&mut buffer))
            .await
            .expect("closed at once, not left waiting");
        assert!(
            matches!(read, Ok(0) | Err(_)),
            "the connection over the cap is closed"
        );
        drop(idle);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(get(addr, "GET /healthz").await.starts_with("HTTP/1.1 200"));
    }

    #[tokio::test]
    async fn a_busy_port_is_an_error_that_names_it() {
        let taken = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = taken.local_addr().unwrap();
        let error = bind_ops(addr).await.unwrap_err().to_string();
        assert!(
            error.starts_with(&format!(
                "cannot listen on {addr} for /metrics, /healthz and /readyz"
            )),
            "{error}"
        );
    }
}
