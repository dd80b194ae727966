//! A real `confed serve` process for the benchmarks that measure it from outside (`flood`,
//! `round`): the release binary (`cargo build --release` first, or `CONFED_BIN`), started on a
//! free loopback port in a temp data directory, with what it prints on start read back.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Sender;

// Each benchmark reads what it needs of a started server.
#[allow(dead_code)]
pub(crate) struct Server {
    pub child: Child,
    pub url: String,
    /// The `demo` tenant's token (printed on the first start).
    pub token: String,
    /// The embedded key services' device trust file.
    pub trust: String,
    /// The embedded key services' base URLs.
    pub keyservices: Vec<String>,
    /// Each aggregated round's job as its log line gives it, in order.
    pub jobs: std::sync::mpsc::Receiver<JobLog>,
    /// The `confed-enclave` process, when rounds are aggregated outside the server.
    pub worker: Option<Child>,
    /// What a `confed-enclave` needs to work for this server: the worker token, the dev
    /// attester's key file, the key services as `ID=URL`.
    pub worker_token: String,
    pub dev_key: String,
    pub named_keyservices: Vec<String>,
    _dir: tempfile::TempDir,
}

impl Server {
    /// Creates a task of the demo tenant from `spec` (the `POST /v1/tasks` body) and uploads
    /// `model` as its first version; returns the task's id.
    #[allow(dead_code)]
    pub(crate) async fn open_task(
        &self,
        http: &reqwest::Client,
        spec: serde_json::Value,
        model: Vec<u8>,
    ) -> String {
        let created = http
            .post(format!("{}/v1/tasks", self.url))
            .bearer_auth(&self.token)
            .json(&spec)
            .send()
            .await
            .unwrap();
        assert!(created.status().is_success(), "task: {}", created.status());
        let created: serde_json::Value = created.json().await.unwrap();
        let task = created["id"].as_str().expect("a task id").to_string();
        let uploaded = http
            .put(format!("{}/v1/tasks/{task}/model", self.url))
            .bearer_auth(&self.token)
            .header("content-type", "application/octet-stream")
            .body(model)
            .send()
            .await
            .unwrap();
        assert!(
            uploaded.status().is_success(),
            "model: {}",
            uploaded.status()
        );
        task
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        for child in std::iter::once(&mut self.child).chain(self.worker.as_mut()) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The `confed` binary the benchmark runs: `CONFED_BIN`, else the workspace's release build.
pub(crate) fn binary() -> String {
    std::env::var("CONFED_BIN")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/target/release/confed").into())
}

/// The `confed-enclave` binary: `CONFED_ENCLAVE_BIN`, else the workspace's release build.
#[allow(dead_code)]
pub(crate) fn enclave_binary() -> String {
    std::env::var("CONFED_ENCLAVE_BIN").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/target/release/confed-enclave").into()
    })
}

/// Who aggregates: the in-process worker of `confed serve`, or a `confed-enclave` process
/// reaching it over the worker API (`CONFED_ENCLAVE_BIN`, else the workspace's release build:
/// `cargo build --release -p confed-enclave`).
#[allow(dead_code)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum WorkerKind {
    InProcess,
    Remote,
    /// No worker started with the server, which cuts rounds into this many partitions
    /// (`--partition-workers`): the benchmark starts the workers itself.
    Partitioned(u32),
}

/// One aggregated round as the worker logged it: the job's time after its lease (`seconds=`)
/// and each step's (`phases="lease 3 ms, read 40 ms, ..."`).
#[allow(dead_code)]
pub(crate) struct JobLog {
    pub seconds: f64,
    pub phases: String,
}

#[allow(dead_code)]
impl JobLog {
    /// The time of the step `name` (`lease`, `read`, `key`, `open`, ...) in seconds, NaN when
    /// the line does not give it.
    pub(crate) fn step(&self, name: &str) -> f64 {
        self.phases
            .split(", ")
            .find_map(|step| {
                let ms = step.strip_prefix(name)?.strip_prefix(' ')?;
                ms.strip_suffix(" ms")?.parse::<f64>().ok()
            })
            .map_or(f64::NAN, |ms| ms / 1e3)
    }
}

/// The value of `key=` in a log line: quoted, up to the next space, or (`phases`, the last
/// field, written unquoted) the rest of the line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let rest = line.split_once(&format!(" {key}="))?.1;
    match rest.strip_prefix('"') {
        Some(quoted) => quoted.split_once('"').map(|(value, _)| value),
        None if key == "phases" => Some(rest),
        None => rest.split(' ').next(),
    }
}

/// Forwards a process's log to ours, sending each line holding `marker` as a `JobLog`.
fn forward_log(
    log: impl std::io::Read + Send + 'static,
    marker: &'static str,
    jobs: Sender<JobLog>,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(log).lines().map_while(Result::ok) {
            eprintln!("{line}");
            if !line.contains(marker) {
                continue;
            }
            let seconds = field(&line, "seconds").and_then(|s| s.parse().ok());
            if let Some(seconds) = seconds {
                let phases = field(&line, "phases").unwrap_or_default().to_string();
                let _ = jobs.send(JobLog { seconds, phases });
            }
        }
    });
}

/// Starts `confed serve` (the embedded system) and waits until it listens.
#[allow(dead_code)]
pub(crate) fn start() -> Server {
    start_with(WorkerKind::InProcess)
}

/// `start`, with rounds aggregated by the worker `aggregator`.
pub(crate) fn start_with(aggregator: WorkerKind) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let worker_token = format!("bench-worker-token-{}", std::process::id()).repeat(2);
    let mut command = Command::new(binary());
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("data"))
        // Errors, and each aggregated round's line with the time of its steps.
        .env(
            "RUST_LOG",
            "error,confed::aggregation=info,confed::embedded::serve=info",
        )
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if aggregator != WorkerKind::InProcess {
        command
            .args(["--role", "api", "--role", "scheduler"])
            .env("CONFED_WORKER_TOKEN", &worker_token);
    }
    if let WorkerKind::Partitioned(workers) = aggregator {
        command
            .args(["--partition-workers", &workers.to_string()])
            .args(["--partition-min-contributions", "1"]);
    }
    let mut child = command
        .spawn()
        .expect("the release binary (cargo build --release) or CONFED_BIN");
    let (job_tx, jobs) = std::sync::mpsc::channel();
    forward_log(
        child.stderr.take().unwrap(),
        "round aggregated",
        job_tx.clone(),
    );
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut token, mut trust, mut keyservices, mut named, mut dev_key) = (
        String::new(),
        String::new(),
        Vec::new(),
        Vec::new(),
        String::new(),
    );
    let url = loop {
        let line = lines.next().expect("server output").unwrap();
        if let Some(t) = line.strip_prefix("CONFED_DEMO_TOKEN=") {
            token = t.into();
        }
        if let Some((_, path)) = line.split_once("Device trust file: ") {
            trust = path.into();
        }
        if let Some((_, path)) = line.split_once("(for confed-enclave --attester dev --dev-key): ")
        {
            dev_key = path.into();
        }
        if let Some(list) = line.strip_prefix("confed: embedded key services: ") {
            named = list.split(' ').map(str::to_string).collect();
            keyservices = named
                .iter()
                .filter_map(|e| e.split_once('=').map(|(_, url)| url.to_string()))
                .collect();
        }
        if let Some(url) = line.strip_prefix("confed: serving on ") {
            break url.to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    let worker = (aggregator == WorkerKind::Remote).then(|| {
        let mut command = Command::new(enclave_binary());
        command
            .args(["--server", &url, "--threshold", "2", "--attester", "dev"])
            .args(["--dev-key", &dev_key, "--id", "bench-enclave"])
            .args(["--ops-listen", "127.0.0.1:0"])
            .env("CONFED_WORKER_TOKEN", &worker_token)
            .env("RUST_LOG", "error,confed_enclave=info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let distance = key_service_distance();
        for service in named.iter() {
            match distance {
                Some(delay) => command.args(["--keyservice", &farther(service, delay)]),
                None => command.args(["--keyservice", service]),
            };
        }
        if let Ok(mib) = std::env::var("CONFED_BENCH_RETAIN_MIB") {
            command.args(["--retain-mib", &mib]);
        }
        let mut worker = command
            .spawn()
            .expect("cargo build --release -p confed-enclave, or CONFED_ENCLAVE_BIN");
        forward_log(worker.stderr.take().unwrap(), "round released", job_tx);
        worker
    });
    Server {
        child,
        worker,
        url,
        token,
        trust,
        keyservices,
        jobs,
        worker_token,
        dev_key,
        named_keyservices: named,
        _dir: dir,
    }
}

/// `CONFED_BENCH_KEY_DELAY_MS`: how far (one way) the remote worker's key services are. In
/// production they are other operators' services, a round trip or more away from the enclave;
/// here they run in the server on loopback. Unset: as they are.
fn key_service_distance() -> Option<std::time::Duration> {
    let ms: u64 = std::env::var("CONFED_BENCH_KEY_DELAY_MS")
        .ok()?
        .parse()
        .ok()?;
    eprintln!("the remote worker's key services are {ms} ms away each way (a delaying relay)");
    Some(std::time::Duration::from_millis(ms))
}

/// `ID=URL` of a key service, with URL's host and port replaced by a relay on loopback that
/// holds every chunk `delay` before passing it on, each way (TLS passes through untouched; the
/// TCP handshake itself is not delayed, so a new connection costs a round trip less than a far
/// service's would). Its threads live as long as the bench.
fn farther(service: &str, delay: std::time::Duration) -> String {
    let (id, url) = service.split_once('=').expect("ID=URL");
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
    let upstream: std::net::SocketAddr = authority
        .replace("localhost", "127.0.0.1")
        .parse()
        .expect("a key service at an IP address and port");
    let relay = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = relay.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for client in relay.incoming().flatten() {
            let Ok(server) = std::net::TcpStream::connect(upstream) else {
                continue;
            };
            // Each chunk as it comes: Nagle's wait would add to the delay.
            let _ = (client.set_nodelay(true), server.set_nodelay(true));
            let (client_out, server_out) =
                (client.try_clone().unwrap(), server.try_clone().unwrap());
            delay_pump(client, server_out, delay);
            delay_pump(server, client_out, delay);
        }
    });
    let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
    format!("{id}={scheme}://{host}:{port}/{path}")
}

/// Copies `from` to `to`, each chunk written `delay` after it was read (a reader and a writer
/// thread, so chunks in flight overlap as on a long link); shuts `to`'s writing down at the end.
fn delay_pump(
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    delay: std::time::Duration,
) {
    use std::io::{Read, Write};
    let (tx, rx) = std::sync::mpsc::channel::<(std::time::Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        let mut buffer = vec![0u8; 64 << 10];
        while let Ok(read) = from.read(&mut buffer) {
            if read == 0
                || tx
                    .send((std::time::Instant::now(), buffer[..read].to_vec()))
                    .is_err()
            {
                break;
            }
        }
    });
    std::thread::spawn(move || {
        for (at, chunk) in rx {
            std::thread::sleep((at + delay).saturating_duration_since(std::time::Instant::now()));
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
}
