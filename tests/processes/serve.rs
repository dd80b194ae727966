//! End to end: the real `confed` binary, started as a process on a loopback port.
//!
//! Not run again on PostgreSQL and GCS (.ci/run): `confed serve` with its own data directories
//! (SQLite), as a first start makes them.

use crate::common;

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use common::process::wait_for_model;
use common::serving::{confed, serving};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

const ADMIN: &str = "process-test-admin-token-0123456789abcdef";
/// Upper bound for the server to print a line; only reached if something is broken.
const STARTUP_BOUND: Duration = Duration::from_secs(60);

struct Server {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    url: String,
    demo_token: Option<String>,
}

async fn start(data_dir: &Path, extra: &[&str]) -> Server {
    let mut command = confed();
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .args(extra)
        .env("CONFED_ADMIN_TOKEN", ADMIN);
    let started = serving(command, STARTUP_BOUND).await;
    Server {
        child: started.child,
        lines: started.lines,
        url: started.url,
        demo_token: started.demo_token,
    }
}

async fn terminate(mut server: Server) -> std::process::ExitStatus {
    let pid = server.child.id().unwrap().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .unwrap();
    assert!(killed.success());
    while let Ok(Some(_)) = server.lines.next_line().await {}
    tokio::time::timeout(STARTUP_BOUND, server.child.wait())
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn serve_creates_demo_tenant_once_and_keeps_state_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), &[]).await;
    assert!(server.url.starts_with("http://127.0.0.1:"));
    let token = server
        .demo_token
        .clone()
        .expect("first start prints the demo token");
    let http = confed_protocol::http::client(STARTUP_BOUND);
    let health = http
        .get(format!("{}/healthz", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);

    let task = json!({
        "population": "demo", "rounds": 2, "report_goal": 3,
        "privacy": {"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0},
    });
    let created = http
        .post(format!("{}/v1/tasks", server.url))
        .bearer_auth(&token)
        .json(&task)
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    let id = created.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let status = terminate(server).await;
    assert!(status.success(), "graceful shutdown exits 0, got {status}");

    let server = start(dir.path(), &[]).await;
    assert_eq!(
        server.demo_token, None,
        "the demo token is shown only on the first start"
    );
    let fetched = http
        .get(format!("{}/v1/tasks/{id}", server.url))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(
        fetched.status(),
        200,
        "acknowledged task survives a restart"
    );
    assert!(terminate(server).await.success());
}

#[tokio::test]
async fn a_scheduler_only_process_serves_only_metrics_and_probes_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = confed()
        .args([
            "serve",
            "--role",
            "scheduler",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
        ])
        .arg(dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (announced, url) = tokio::time::timeout(STARTUP_BOUND, async {
        let mut announced = None;
        loop {
            let line = lines.next_line().await.unwrap().expect("exited early");
            if line.starts_with("confed: running") {
                announced = Some(line);
            } else if let Some(url) = line.strip_prefix("confed: serving on ") {
                return (announced, url.to_string());
            }
        }
    })
    .await
    .expect("the scheduler did not start");
    assert_eq!(
        announced.as_deref(),
        Some(
            "confed: running [Scheduler] (no API role: serving /metrics, /healthz and /readyz only)"
        )
    );
    let http = confed_protocol::http::client(Duration::from_secs(10));
    let get = |path: &str| http.get(format!("{url}{path}")).send();
    assert_eq!(get("/healthz").await.unwrap().status(), 200);
    let ready = get("/readyz").await.unwrap();
    assert_eq!(ready.status(), 200);
    assert_eq!(ready.text().await.unwrap(), "ready");
    let metrics = get("/metrics").await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains(&format!(
            "confed_build_info{{process=\"confed\",version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        )),
        "{metrics}"
    );
    assert!(
        metrics.contains("confed_round_deadlines_total{outcome=\"task_failed\"} 0"),
        "the alerted series exist from the start: {metrics}"
    );
    assert!(
        metrics.contains("process_resident_memory_bytes"),
        "{metrics}"
    );
    assert_eq!(
        get("/v1/tasks").await.unwrap().status(),
        404,
        "no API on a scheduler"
    );
    let pid = child.id().unwrap().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .await
            .unwrap()
            .success()
    );
    let status = tokio::time::timeout(STARTUP_BOUND, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status}");
}

/// A first start on a busy port used to create the data directory and print the demo tenant's
/// token, "shown only this once", then fail: the next start had no token and no hint.
#[tokio::test]
async fn a_busy_port_stops_a_first_start_before_it_creates_anything() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let data = dir.path().join("data");
    let output = confed()
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(&data)
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("cannot listen on 127.0.0.1:{port}")),
        "{stderr}"
    );
    assert!(
        output.stdout.is_empty(),
        "no token printed: {:?}",
        String::from_utf8_lossy(&output.stdout)
    );
    assert!(!data.exists(), "no data directory left behind");

    // Nor does a certificate that cannot be loaded.
    let output = confed()
        .args(["serve", "--listen", "127.0.0.1:0", "--tls-cert"])
        .arg(dir.path().join("missing.pem"))
        .arg("--tls-key")
        .arg(dir.path().join("missing.key"))
        .arg("--data-dir")
        .arg(&data)
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("cannot load the TLS certificate or key"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.stdout.is_empty(), "no token printed");
    assert!(!data.exists(), "no data directory left behind");
}

#[tokio::test]
async fn an_in_process_worker_with_remote_key_services_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let output = confed()
        .args(["serve", "--role", "enclave-worker"])
        .args(["--keyservice", "http://127.0.0.1:9/", "--data-dir"])
        .arg(dir.path())
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("run confed-enclave in a TEE"), "{stderr}");
}

#[tokio::test]
async fn plain_http_off_loopback_is_refused_with_a_fix() {
    let dir = tempfile::tempdir().unwrap();
    let output = confed()
        .args(["serve", "--listen", "0.0.0.0:0", "--data-dir"])
        .arg(dir.path())
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("not a loopback address") && stderr.contains("--tls-cert"),
        "{stderr}"
    );
}

#[tokio::test]
async fn tenant_create_prints_only_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let output = confed()
        .args(["tenant", "create", "acme", "--data-dir"])
        .arg(dir.path())
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout).unwrap();
    let lines: Vec<_> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "{stdout}");
    assert!(lines[0].starts_with("cft_"));

    let duplicate = confed()
        .args(["tenant", "create", "acme", "--data-dir"])
        .arg(dir.path())
        .output()
        .await
        .unwrap();
    assert!(!duplicate.status.success());
    assert!(String::from_utf8_lossy(&duplicate.stderr).contains("already exists"));

    let list = confed()
        .args(["tenant", "list", "--data-dir"])
        .arg(dir.path())
        .output()
        .await
        .unwrap();
    let listed = String::from_utf8(list.stdout).unwrap();
    assert!(listed.starts_with("acme\t") && !listed.contains(lines[0]));

    // A mistyped directory is an error, not a new empty database.
    let typo = dir.path().join("typo");
    let list = confed()
        .args(["tenant", "list", "--data-dir"])
        .arg(&typo)
        .output()
        .await
        .unwrap();
    assert!(!list.status.success());
    let stderr = String::from_utf8_lossy(&list.stderr);
    assert!(
        stderr.contains("no task database at") && stderr.contains("is --data-dir right?"),
        "{stderr}"
    );
    assert!(!typo.exists(), "nothing created at the typo");
}

#[tokio::test]
async fn serves_tls_with_operator_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let cert_path = dir.path().join("cert.pem");
    let key_path = dir.path().join("key.pem");
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    let data = dir.path().join("data");
    let server = start(
        &data,
        &[
            "--tls-cert",
            cert_path.to_str().unwrap(),
            "--tls-key",
            key_path.to_str().unwrap(),
        ],
    )
    .await;
    let addr = server
        .url
        .strip_prefix("https://")
        .expect("TLS server announces https");

    let connector = tokio_rustls::TlsConnector::from(tls_client_config(&cert));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = connector.connect(name.clone(), tcp).await.unwrap();
    tls.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut response = String::new();
    tls.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.ends_with("ok"), "{response}");

    // Over TLS the console's session cookie is Secure and __Host- prefixed.
    let port = addr.rsplit_once(':').unwrap().1;
    let token = server
        .demo_token
        .clone()
        .expect("a new data directory prints its token");
    let body = format!("token={token}");
    let request = format!(
        "POST /console/sign-in HTTP/1.1\r\nHost: localhost:{port}\r\n\
         Origin: https://localhost:{port}\r\n\
         Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut tls = connector.connect(name, tcp).await.unwrap();
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    tls.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 303"), "{response}");
    let cookie = response
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("set-cookie:"))
        .expect("a session cookie");
    assert!(cookie.contains("__Host-confed_session="), "{cookie}");
    assert!(
        cookie.contains("; Secure") && cookie.contains("HttpOnly"),
        "{cookie}"
    );

    // The same over HTTP/2, as browsers send it: the host is the URI's authority, and there is
    // no Host header for the console's same-origin check to read.
    let mut h2_config = (*tls_client_config(&cert)).clone();
    h2_config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(h2_config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = connector.connect(name, tcp).await.unwrap();
    assert_eq!(
        tls.get_ref().1.alpn_protocol(),
        Some(&b"h2"[..]),
        "the server speaks HTTP/2"
    );
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tls),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let request = http::Request::post(format!("https://localhost:{port}/console/sign-in"))
        .header("origin", format!("https://localhost:{port}"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(
        response.status(),
        303,
        "an HTTP/2 sign-in from this origin is accepted"
    );
    let cookie = response.headers()["set-cookie"].to_str().unwrap();
    assert!(cookie.starts_with("__Host-confed_session="), "{cookie}");
    assert!(terminate(server).await.success());
}

/// A TLS client configuration trusting the test's self-signed certificate.
fn tls_client_config(
    cert: &rcgen::CertifiedKey<rcgen::KeyPair>,
) -> Arc<tokio_rustls::rustls::ClientConfig> {
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    roots.add(cert.cert.der().clone()).unwrap();
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Arc::new(config)
}

async fn devices(url: &str, trust: &Path, first: u64) {
    let config = common::process::simulated_devices(url, "embedded", trust, 8, first, 30);
    let summary = confed::tools::simulate::run(config).await.unwrap();
    assert_eq!(summary.contributions, 8, "{:?}", summary.failures);
}

/// `confed serve` with no key services runs the whole system: embedded key services and an
/// enclave worker (dev attester) complete rounds, and their keys survive a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_alone_runs_rounds_with_its_embedded_enclave_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = start(&data, &[]).await;
    let token = server.demo_token.clone().unwrap();
    let http = confed_protocol::http::client(STARTUP_BOUND);
    let task = common::open_task_over_http(
        &server.url,
        &token,
        common::with_fast_window(json!({
            "population": "embedded", "rounds": 2, "report_goal": 8,
            "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0},
        })),
        confed::tools::simulate::initial_model(7),
    )
    .await;
    let trust = data.join("embedded").join("trust.json");
    devices(&server.url, &trust, 0).await;
    wait_for_model(&server.url, &token, &task, 1).await;
    assert!(terminate(server).await.success());

    // Restarted: the same key services' keys and shares, so devices that trusted them before
    // still do, and round 2 completes the task.
    let server = start(&data, &[]).await;
    devices(&server.url, &trust, 8).await;
    wait_for_model(&server.url, &token, &task, 2).await;
    let state: serde_json::Value = http
        .get(format!("{}/v1/tasks/{task}", server.url))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(state["state"], "COMPLETED");
    // Each release verifies offline against the devices' trust file (signed by the enclave,
    // receipts of the key services the devices trust) and the policy the partner saw.
    let policy = dir.path().join("policy.txt");
    std::fs::write(&policy, state["policy"].as_str().unwrap()).unwrap();
    let verify = |round: &'static str, policy: std::path::PathBuf| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_confed"))
            .args(["verify", "release", "--server", &server.url])
            .args(["--task", &task, "--round", round, "--trust"])
            .arg(&trust)
            .arg("--policy")
            .arg(policy)
            .env("CONFED_TOKEN", &token)
            .output()
    };
    let looser = dir.path().join("looser-policy.txt");
    std::fs::write(
        &looser,
        state["policy"]
            .as_str()
            .unwrap()
            .replace("epsilon=5e1", "epsilon=1e2"),
    )
    .unwrap();
    let refused = verify("1", looser).await.unwrap();
    assert!(!refused.status.success(), "a release under another policy");
    assert!(
        String::from_utf8_lossy(&refused.stdout)
            .contains("FAILED: the release names the expected policy")
    );
    for round in ["1", "2"] {
        let verify = verify(round, policy.clone()).await.unwrap();
        let stdout = String::from_utf8_lossy(&verify.stdout);
        assert!(
            verify.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&verify.stderr)
        );
        assert!(stdout.contains("VERIFIED"), "{stdout}");
        assert!(stdout.contains("ok: receipt of key service ks"), "{stdout}");
    }
    assert!(terminate(server).await.success());
}

/// The data directory and database were created 0755/0644 where docs/operations.md says
/// owner-only: both are tightened (an existing directory too) and new ones are created so.
#[tokio::test]
async fn the_data_directory_and_database_are_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
    let server = start(&data, &[]).await;
    let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&data), 0o700);
    assert_eq!(mode(&data.join("confed.db")), 0o600);
    for entry in std::fs::read_dir(&data).unwrap() {
        let path = entry.unwrap().path();
        assert_eq!(
            mode(&path) & 0o077,
            0,
            "{} is readable by others",
            path.display()
        );
    }
    terminate(server).await;
}

/// `CONFED_LOG_FORMAT=json`: one JSON object a line on stderr; an unknown format is refused at
/// start with the choices.
#[tokio::test]
async fn logs_are_json_lines_on_request_and_an_unknown_format_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = confed()
        .args([
            "serve",
            "--role",
            "scheduler",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
        ])
        .arg(dir.path())
        .env("CONFED_LOG_FORMAT", "json")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let first = tokio::time::timeout(STARTUP_BOUND, lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .expect("a log line");
    child.kill().await.unwrap();
    let event: serde_json::Value = serde_json::from_str(&first).expect("a JSON object");
    assert!(
        event["level"].is_string()
            && event["target"].is_string()
            && event["timestamp"].is_string()
            && event["message"].is_string(),
        "{first}"
    );

    let refused = confed()
        .args(["tenant", "list", "--data-dir"])
        .arg(dir.path())
        .env("CONFED_LOG_FORMAT", "xml")
        .output()
        .await
        .unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains(
            "CONFED_LOG_FORMAT=\"xml\" is not a log format: use text (the default) or json"
        ),
        "{stderr}"
    );
}
