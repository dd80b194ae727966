//! `CONFED_BENCH_WORKERS=K` (issue 33): one round of the benchmark's contributions cut into K
//! partitions (`confed serve --partition-workers K`). At the round's close, K `confed-enclave
//! --once` processes start, one partition each; then this process, as the root (a `Worker` over
//! the worker API, the dev attester with the server's key), leases the merge, runs it and
//! commits model version 1. Afterwards it aggregates the same committed round as one worker
//! would (the same commitment: the key services grant it again) and prints whether that release
//! is byte for byte the committed one. From the measured steps it projects the turnaround on K
//! machines of this one's size (the K processes here share its 2 cores, so their wall times are
//! not a K-machine figure).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use confed_attestation::DevAttester;
use confed_enclave::key_collection::KeyServiceEndpoint;
use confed_enclave::remote::HttpJobStore;
use confed_enclave::worker::{Phases, Worker, WorkerConfig, round_context};
use confed_worker_api::model::validate_model;
use confed_worker_api::store::{JobSpec, JobStore, Partitioning, StagedRelease, StoreError};

use crate::process::{Server, WorkerKind, enclave_binary, start_with};
use crate::{model, simulate, spec};

/// Partitions (and partition workers): `CONFED_BENCH_WORKERS`, when set to 1 or more.
pub(crate) fn workers() -> Option<u32> {
    std::env::var("CONFED_BENCH_WORKERS")
        .ok()
        .and_then(|k| k.parse().ok())
        .filter(|k| *k >= 1)
}

/// A job's steps in seconds, as its worker logged them (`seconds=`, `phases=...`).
#[derive(Debug, Default, Clone, Copy)]
struct Steps {
    seconds: f64,
    key: f64,
    open: f64,
    /// `noise`: for a partition, sealing it.
    seal: f64,
    /// `release`: for a partition, storing it.
    store: f64,
}

impl Steps {
    fn from_phases(phases: &Phases) -> Self {
        Self {
            seconds: phases.after_lease().as_secs_f64(),
            key: phases.key.as_secs_f64(),
            open: phases.open.as_secs_f64(),
            seal: phases.noise.as_secs_f64(),
            store: phases.release.as_secs_f64(),
        }
    }

    fn from_log(line: &str) -> Option<Self> {
        let (_, phases) = line.split_once("phases=")?;
        let ms = |name: &str| -> Option<f64> {
            let (_, rest) = phases.split_once(&format!("{name} "))?;
            Some(rest.split(' ').next()?.parse::<f64>().ok()? / 1e3)
        };
        let seconds = line
            .split_once(" seconds=")?
            .1
            .split(' ')
            .next()?
            .parse()
            .ok()?;
        Some(Self {
            seconds,
            key: ms("key")?,
            open: ms("open")?,
            seal: ms("noise")?,
            store: ms("release")?,
        })
    }
}

/// A `confed-enclave --once` process for partition `index`; its "partition sealed" line's
/// steps go to `sealed`.
fn partition_worker(server: &Server, index: u32, sealed: Sender<Steps>) -> Child {
    let mut command = Command::new(enclave_binary());
    command
        .args([
            "--server",
            &server.url,
            "--threshold",
            "2",
            "--attester",
            "dev",
        ])
        .args([
            "--dev-key",
            &server.dev_key,
            "--id",
            &format!("bench-part-{index}"),
        ])
        .args(["--ops-listen", "127.0.0.1:0", "--once"])
        .env("CONFED_WORKER_TOKEN", &server.worker_token)
        .env("RUST_LOG", "error,confed_enclave=info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for service in &server.named_keyservices {
        command.args(["--keyservice", service]);
    }
    let mut child = command
        .spawn()
        .expect("cargo build --release -p confed-enclave, or CONFED_ENCLAVE_BIN");
    let log = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(log).lines().map_while(Result::ok) {
            if line.contains("partition sealed") {
                let _ = sealed.send(Steps::from_log(&line).expect("a partition's steps"));
            } else if line.contains("ERROR") || line.contains("WARN") {
                eprintln!("{line}");
            }
        }
    });
    child
}

/// The worker API for the check after the round: it reads the committed round's contributions
/// again, and there is no lease to renew any more (the job is done); nothing else.
struct Rereading(Arc<HttpJobStore>);

impl JobStore for Rereading {
    async fn lease(&self, _: &str, _: Duration) -> Result<Option<JobSpec>, StoreError> {
        Ok(None)
    }
    async fn renew(&self, _: &str, _: &str, _: Duration) -> Result<(), StoreError> {
        Ok(())
    }
    async fn fetch(&self, blob_key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.0.fetch(blob_key).await
    }
    async fn fetch_into(
        &self,
        blob_key: &str,
        buffer: Vec<u8>,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.0.fetch_into(blob_key, buffer).await
    }
    async fn commit_release(
        &self,
        _: &str,
        _: &str,
        _: StagedRelease<'_>,
    ) -> Result<(), StoreError> {
        Err(StoreError::Refused("a check commits nothing".into()))
    }
    async fn commit_model(
        &self,
        _: &str,
        _: &str,
        _: &[u8],
        _: Option<&[u8]>,
    ) -> Result<(), StoreError> {
        Err(StoreError::Refused("a check commits nothing".into()))
    }
    async fn fetch_sealed(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.0.fetch_sealed(key).await
    }
    async fn put_partition(&self, _: &str, _: &str, _: &[u8]) -> Result<(), StoreError> {
        Err(StoreError::Refused("a check stores nothing".into()))
    }
    async fn fail(&self, _: &str, _: &str, _: &str, _: bool) -> Result<(), StoreError> {
        Ok(())
    }
}

/// The root: this process's worker over the worker API, trusted like `confed-enclave --attester
/// dev` with the server's dev key; and a worker for the check after the round.
fn root_worker(server: &Server) -> (Arc<HttpJobStore>, Worker<HttpJobStore>, Worker<Rereading>) {
    let store = Arc::new(
        HttpJobStore::new(
            &server.url,
            zeroize::Zeroizing::new(server.worker_token.clone()),
            Duration::from_secs(120),
        )
        .with_lease_wait(Duration::from_secs(20)),
    );
    let clock = Arc::new(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64)
    });
    let attester: Arc<dyn confed_attestation::Attester> = Arc::new(
        DevAttester::from_key_file(std::path::Path::new(&server.dev_key), clock)
            .expect("the server's dev key"),
    );
    let key_services: Vec<KeyServiceEndpoint> = server
        .named_keyservices
        .iter()
        .map(|named| {
            let (id, url) = named.split_once('=').unwrap();
            KeyServiceEndpoint {
                id: id.into(),
                url: url.into(),
            }
        })
        .collect();
    let config = || WorkerConfig {
        id: "bench-root/1".into(),
        lease: Duration::from_secs(600),
        key_services: key_services.clone(),
        threshold: 2,
        attester: attester.clone(),
        key_timeout: Duration::from_secs(10),
        batch: 256,
        batch_bytes: 16 << 20,
    };
    let checker = Worker::new(Arc::new(Rereading(Arc::clone(&store))), config());
    (Arc::clone(&store), Worker::new(store, config()), checker)
}

async fn bytes(http: &reqwest::Client, server: &Server, path: &str) -> Vec<u8> {
    let response = http
        .get(format!("{}{path}", server.url))
        .bearer_auth(&server.token)
        .send()
        .await
        .unwrap();
    assert!(
        response.status().is_success(),
        "{path}: {}",
        response.status()
    );
    response.bytes().await.unwrap().to_vec()
}

pub(crate) async fn run(devices: usize, workers: u32) {
    let http = confed_protocol::http::client(Duration::from_secs(60));
    println!(
        "== a partitioned round: {devices} devices x 1 MB, {workers} partitions, each by a confed-enclave --once process started at the close, merged by a root over the worker API (all on this machine's cores)"
    );
    let server = start_with(WorkerKind::Partitioned(workers));
    let population = "round-partitioned";
    let task = server
        .open_task(&http, spec(population, devices, 10.0), model())
        .await;
    let watching = {
        let (http, task) = (http.clone(), task.clone());
        let server_url = server.url.clone();
        let token = server.token.clone();
        tokio::spawn(async move {
            loop {
                let rounds: serde_json::Value = http
                    .get(format!("{server_url}/v1/tasks/{task}/rounds"))
                    .bearer_auth(&token)
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                if rounds["rounds"][0]["state"].as_str() != Some("COLLECTING") {
                    return Instant::now();
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let collection = simulate(&server, population, devices, None).await;
    let closed_at = watching.await.unwrap();
    let (sealed_tx, sealed_rx) = std::sync::mpsc::channel();
    let mut children: Vec<Child> = (0..workers)
        .map(|index| partition_worker(&server, index, sealed_tx.clone()))
        .collect();
    let partitions: Vec<Steps> = (0..workers)
        .map(|_| {
            sealed_rx
                .recv_timeout(Duration::from_secs(3600))
                .expect("every partition sealed")
        })
        .collect();
    for child in &mut children {
        let _ = child.wait();
    }
    // The root: its lease (the job and the model; the sealed partitions are fetched by the
    // merge, one at a time).
    let (store, root_worker, checker) = root_worker(&server);
    let leasing = Instant::now();
    let root = loop {
        if let Some(job) = store
            .lease("bench-root/1", Duration::from_secs(600))
            .await
            .unwrap()
        {
            break job;
        }
    };
    let lease = leasing.elapsed().as_secs_f64();
    let Some(Partitioning::Root { count, .. }) = &root.partitioning else {
        panic!("the root's job, got {:?}", root.partitioning);
    };
    assert_eq!(*count, workers);
    let leased_at = Instant::now();
    let outcome = root_worker.run_job(&root).await.unwrap();
    let root_steps = Steps::from_phases(&outcome.phases);
    let turnaround = leased_at.duration_since(closed_at).as_secs_f64() + root_steps.seconds;
    // One worker's release of the same round, and the committed one.
    let whole_job = JobSpec {
        partitioning: None,
        ..root.clone()
    };
    let (policy, context) = round_context(&whole_job).unwrap();
    let schema = validate_model(&whole_job.model).unwrap();
    let mut phases = Phases::default();
    let (whole, _) = checker
        .aggregate(&whole_job, &schema, &policy, context, &mut phases)
        .await
        .unwrap();
    let whole_steps = Steps::from_phases(&phases);
    let average = bytes(
        &http,
        &server,
        &format!("/v1/tasks/{task}/releases/1/average"),
    )
    .await;
    let manifest = bytes(
        &http,
        &server,
        &format!("/v1/tasks/{task}/releases/1/manifest"),
    )
    .await;
    let identical = average == whole.average && manifest == whole.manifest.to_json();
    println!(
        "release identical to one worker: {}",
        if identical { "yes" } else { "NO" }
    );
    assert!(identical, "a partitioned release differs from one worker's");
    report(
        devices,
        workers,
        collection,
        turnaround,
        &partitions,
        lease,
        &root_steps,
        &whole_steps,
    );
}

/// The measured steps, and the projection to K machines.
#[allow(clippy::too_many_arguments)]
fn report(
    devices: usize,
    workers: u32,
    collection: f64,
    turnaround: f64,
    partitions: &[Steps],
    lease: f64,
    root: &Steps,
    whole: &Steps,
) {
    let mean =
        |f: fn(&Steps) -> f64| partitions.iter().map(f).sum::<f64>() / partitions.len() as f64;
    let slowest = partitions.iter().map(|p| p.seconds).fold(0.0, f64::max);
    println!(
        "collection {collection:.2} s; turnaround {turnaround:.2} s on this machine (close to model 1, the {workers} processes sharing its cores)"
    );
    println!(
        "partition jobs: slowest {slowest:.2} s; mean key {:.3} s, open {:.3} s, seal {:.3} s, store {:.3} s",
        mean(|p| p.key),
        mean(|p| p.open),
        mean(|p| p.seal),
        mean(|p| p.store)
    );
    println!(
        "root: lease {lease:.3} s, job {:.3} s (key {:.3} s, fetch and merge of the {workers} partitions {:.3} s, noise {:.3} s, release and update {:.3} s)",
        root.seconds,
        root.key,
        root.open,
        root.seal,
        root.seconds - root.key - root.open - root.seal
    );
    println!(
        "one worker, same round, in this process: key {:.3} s, open {:.3} s ({:.2} GB/s), noise {:.3} s",
        whole.key,
        whole.open,
        devices as f64 * 1.05e-3 / whole.open,
        whole.seal
    );
    // Projection: K machines like this one, each running one partition alone. Per contribution
    // the open step of one worker alone; per partition a lease (the root's), its key, seal and
    // store; per merged partition the root's fetch and merge; once the root's lease, key,
    // noise, release and update (the one worker's job pays a lease, its key and that tail too).
    let per_contribution = whole.open / devices as f64;
    let tail = root.seconds - root.key - root.open;
    let per_merged = root.open / f64::from(workers);
    let partition_fixed = lease + mean(|p| p.key) + mean(|p| p.seal) + mean(|p| p.store);
    let one = |n: f64| lease + whole.key + per_contribution * n + tail;
    let k_machines = |n: f64, k: f64| {
        partition_fixed + per_contribution * n / k + lease + root.key + per_merged * k + tail
    };
    println!(
        "projection (per contribution {:.2} ms, per partition {:.3} s, per merged partition {:.4} s, root's lease, key and tail {:.3} s):",
        per_contribution * 1e3,
        partition_fixed,
        per_merged,
        lease + root.key + tail
    );
    for n in [devices as f64, 100_000.0] {
        let line: Vec<String> = [2.0, 4.0, 8.0, 16.0]
            .iter()
            .map(|&k| {
                let t = k_machines(n, k);
                format!("K={k}: {t:.2} s ({:.1}x)", one(n) / t)
            })
            .collect();
        println!(
            "  {n:.0} x 1 MB: one worker {:.2} s; {}",
            one(n),
            line.join(", ")
        );
    }
}
