//! The worker API client's batch reads against a server that answers whatever the test scripts:
//! the host is untrusted, and every way a batch's body can be wrong must fail the read, never
//! hand the job fewer, more or different contributions than were named.

use super::*;
use confed_worker_api::batch::encode as frames;
use futures_util::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A server that answers one request with `response` (status line, headers and body, as sent)
/// and closes the connection; its URL.
async fn answering(response: Vec<u8>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut request = Vec::new();
        let mut buffer = [0u8; 4096];
        // The request's head, then its body (its Content-Length).
        let body_start = loop {
            let n = socket.read(&mut buffer).await.unwrap();
            request.extend_from_slice(&buffer[..n]);
            if let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                break end + 4;
            }
        };
        let head = String::from_utf8_lossy(&request[..body_start]).to_lowercase();
        let length: usize = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length:"))
            .map_or(0, |l| l.trim().parse().unwrap());
        while request.len() < body_start + length {
            let n = socket.read(&mut buffer).await.unwrap();
            request.extend_from_slice(&buffer[..n]);
        }
        socket.write_all(&response).await.unwrap();
        socket.shutdown().await.ok();
    });
    url
}

fn with_length(body: &[u8]) -> Vec<u8> {
    let mut response = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    response.extend_from_slice(body);
    response
}

/// The batch's items up to the first error, and that error.
async fn read_until_error(
    response: Vec<u8>,
    keys: usize,
) -> (Vec<Option<Vec<u8>>>, Option<StoreError>) {
    let url = answering(response).await;
    let store = HttpJobStore::new(&url, Zeroizing::new("t".into()), Duration::from_secs(5));
    let pool = BufferPool::new(1 << 20);
    let names = (0..keys).map(|i| format!("c/{i}")).collect();
    let mut items = Vec::new();
    let mut fetched = store.fetch_batch(names, &pool);
    while let Some(item) = fetched.next().await {
        match item {
            Ok(item) => items.push(item),
            Err(error) => return (items, Some(error)),
        }
    }
    (items, None)
}

/// The batch's items, or the first error.
async fn read(response: Vec<u8>, keys: usize) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
    match read_until_error(response, keys).await {
        (items, None) => Ok(items),
        (_, Some(error)) => Err(error),
    }
}

#[tokio::test]
async fn a_whole_batch_reads_every_frame_in_order() {
    let body = frames(&[Some(b"one"), None, Some(b"three")]);
    let items = read(with_length(&body), 3).await.unwrap();
    assert_eq!(
        items,
        [Some(b"one".to_vec()), None, Some(b"three".to_vec())]
    );
}

#[tokio::test]
async fn a_body_cut_short_fails_the_read() {
    // Chunked, and the connection closed before the last chunk (as the server does when a read
    // fails mid-batch): the first frame arrived whole, the second did not.
    let body = frames(&[Some(b"one"), Some(b"two")]);
    let sent = &body[..body.len() - 1];
    let mut response = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    response.extend_from_slice(format!("{:x}\r\n", sent.len()).as_bytes());
    response.extend_from_slice(sent);
    response.extend_from_slice(b"\r\n");
    let (items, error) = read_until_error(response, 2).await;
    assert_eq!(items, [Some(b"one".to_vec())]);
    let error = error.expect("the read fails");
    assert!(error.to_string().contains("broke off"), "{error}");
    // Cut short where the length says more is coming, within a well-formed body.
    let error = read(with_length(&body[..body.len() - 1]), 2)
        .await
        .unwrap_err();
    assert!(
        error.to_string().contains("ended after 1 of its 2"),
        "{error}"
    );
}

#[tokio::test]
async fn a_body_that_goes_on_after_its_frames_fails_the_read() {
    let mut trailing = frames(&[Some(b"one"), Some(b"two")]);
    trailing.push(0);
    let error = read(with_length(&trailing), 2).await.unwrap_err();
    assert!(error.to_string().contains("goes on after"), "{error}");
    // A whole frame more than named.
    let extra = frames(&[Some(b"one"), Some(b"two"), Some(b"three")]);
    let error = read(with_length(&extra), 2).await.unwrap_err();
    assert!(error.to_string().contains("goes on after"), "{error}");
}

#[tokio::test]
async fn a_server_without_the_batch_route_names_the_upgrade() {
    let response = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
    let error = read(response.to_vec(), 1).await.unwrap_err();
    assert!(error.to_string().contains("upgrade the server"), "{error}");
}

#[tokio::test(start_paused = true)]
async fn a_server_that_stops_answering_mid_batch_fails_the_read_after_the_timeout() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let body = frames(&[Some(b"one"), Some(b"two")]);
    let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut buffer = [0u8; 4096];
        let _ = socket.read(&mut buffer).await.unwrap();
        socket.write_all(head.as_bytes()).await.unwrap();
        socket.write_all(&body[..11]).await.unwrap();
        // Holds the connection open, sending nothing more.
        std::future::pending::<()>().await;
        drop(socket);
    });
    let store = HttpJobStore::new(&url, Zeroizing::new("t".into()), Duration::from_secs(5));
    let pool = BufferPool::new(1 << 20);
    let mut fetched = store.fetch_batch(vec!["c/0".into(), "c/1".into()], &pool);
    assert_eq!(
        fetched.next().await.unwrap().unwrap(),
        Some(b"one".to_vec())
    );
    let error = fetched.next().await.unwrap().unwrap_err();
    assert!(error.to_string().contains("did not answer"), "{error}");
    server.abort();
}

/// The enclave reads a batch only as fast as it opens the contributions: a consumer that waits
/// longer than the timeout between frames, with the server's bytes all sent, still reads them all
/// (the timeout bounds waits for the server, not the exchange).
#[tokio::test(start_paused = true)]
async fn a_slow_consumer_reads_the_whole_batch_whatever_its_pauses() {
    let body = frames(&[Some(b"one"), None, Some(b"three")]);
    let url = answering(with_length(&body)).await;
    let store = HttpJobStore::new(&url, Zeroizing::new("t".into()), Duration::from_secs(5));
    let pool = BufferPool::new(1 << 20);
    let names = (0..3).map(|i| format!("c/{i}")).collect();
    let mut fetched = store.fetch_batch(names, &pool);
    let mut items = Vec::new();
    while let Some(item) = fetched.next().await {
        items.push(item.unwrap());
        tokio::time::sleep(Duration::from_secs(12)).await;
    }
    assert_eq!(
        items,
        [Some(b"one".to_vec()), None, Some(b"three".to_vec())]
    );
}

/// A 404 whose problem is of `kind`, with `detail`.
fn answer_404(kind: &str, detail: &str) -> Vec<u8> {
    let body =
        serde_json::json!({"type": kind, "title": "Not found", "status": 404, "detail": detail})
            .to_string();
    let mut response = format!(
        "HTTP/1.1 404 Not Found\r\ncontent-type: application/problem+json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    response.extend_from_slice(body.as_bytes());
    response
}

/// What a server whose worker API is off answers every call.
fn api_off() -> Vec<u8> {
    answer_404(confed_worker_api::wire::API_OFF, "the worker API is off")
}

fn store_at(url: &str) -> HttpJobStore {
    HttpJobStore::new(url, Zeroizing::new("t".into()), Duration::from_secs(5))
}

/// No call under a lease took effect when the server answered 404 (its worker API off): a
/// renewal, a failure report, a lease, a partition's upload or a model's commit is an error
/// that names the server's reason, never a success (a worker that believed its renewal would
/// hold a job its lease no longer covers).
#[tokio::test]
async fn a_404_to_any_call_but_a_read_is_an_error_with_the_servers_reason() {
    let renewed = store_at(&answering(api_off()).await)
        .renew("job", "w/1", Duration::from_secs(60))
        .await;
    let failed = store_at(&answering(api_off()).await)
        .fail("job", "w/1", "why", false)
        .await;
    let leased = store_at(&answering(api_off()).await)
        .lease("w/1", Duration::from_secs(60))
        .await
        .map(|_| ());
    let partition = store_at(&answering(api_off()).await)
        .put_partition("job.p0", "w/1", b"sealed")
        .await;
    let model = store_at(&answering(api_off()).await)
        .commit_model("job", "w/1", b"model", None)
        .await;
    for outcome in [renewed, failed, leased, partition, model] {
        let error = outcome.unwrap_err().to_string();
        assert!(
            error.contains("404") && error.contains("the worker API is off"),
            "{error}"
        );
    }
}

/// A read answered 404 is a missing object only when the server says so (`NOT_FOUND`): a
/// server whose worker API is off, or any other 404, is an error, so a contribution listed
/// without a digest is never committed as missing because of it.
#[tokio::test]
async fn a_404_to_a_read_is_a_missing_object_only_when_the_server_says_so() {
    let missing = answer_404(NOT_FOUND, "contribution c/1 not found");
    assert_eq!(
        store_at(&answering(missing).await)
            .fetch("c/1")
            .await
            .unwrap(),
        None
    );
    let error = store_at(&answering(api_off()).await)
        .fetch("c/1")
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("the worker API is off"), "{error}");
    let bare = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
    assert!(
        store_at(&answering(bare.to_vec()).await)
            .fetch("c/1")
            .await
            .is_err()
    );
}
