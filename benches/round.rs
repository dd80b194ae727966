#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! A whole round as a user runs it (issue 15): a real `confed serve` (the release binary: run
//! `cargo build --release` first, or set CONFED_BIN), a task with a 1 MB model (262,144 f32) and
//! a report goal of 1,000, and `confed devices simulate --no-train` for 1,000 devices from a
//! second process. Prints the collection time (devices checking in, uploading and reporting until
//! the goal closes the round) and the turnaround (from the round's close to model version 1 being
//! readable, both seen by a poller), with the turnaround's GB/s of contributions: once with every
//! update below the clip norm, once with half of them above it and once with all of them above it
//! (the simulator's random updates have an L2 norm of about 2.956). The turnaround is split into
//! the job (from its lease's answer to model N+1, as the worker logs it, with each step) and what
//! came before it (the close reaching a worker and its lease, within the poller's resolution).
//! Next to it: the aggregation benchmark's work for the same bytes, measured in this process on
//! the same cores (`Aggregator` opening and summing 48 contributions of the same size and values,
//! best of three: `cargo bench -p confed-enclave --bench aggregation` measures it the same way),
//! and the peak RSS during the turnaround.
//!
//! Each case runs twice, aggregated by the server's in-process worker and then by a
//! `confed-enclave` process over the worker API as production does (the remote worker:
//! `cargo build --release -p confed-enclave` first), and the bench prints the remote worker's
//! open step against the in-process one's.
//!
//! `cargo bench --bench round`; `CONFED_BENCH_DEVICES=10000` for a 10 GB round;
//! `CONFED_BENCH_WORKER=remote` or `inprocess` for one worker only
//! (`CONFED_BENCH_RETAIN_MIB` sets the remote worker's `--retain-mib`; `CONFED_BENCH_KEY_DELAY_MS=D` puts its key
//! services D ms away each way, behind a delaying relay, as other operators' services are). `CONFED_BENCH_WORKERS=K` cuts the round
//! into K partitions, aggregated by K `confed-enclave` processes and merged by a root
//! (`support/partitioned.rs`). `CONFED_BENCH_MASKED=1` runs a round with device tokens in the
//! clear and then masked beneath the enclave (`secure_aggregation`), and prints the masked
//! turnaround against the clear one (`support/masked_round.rs`).

use std::time::{Duration, Instant};

use confed_enclave::aggregate::{Aggregator, Binding};
use confed_enclave::envelope::{self, RoundContext};
use confed_protocol::hpke::generate_keypair;
use confed_worker_api::model::{encode_f32_tensors, validate_model};

const DEFAULT_DEVICES: usize = 1000;
const PARAMS: usize = 262_144;

/// Devices (and contributions) per round: `CONFED_BENCH_DEVICES`, default 1,000.
fn devices() -> usize {
    std::env::var("CONFED_BENCH_DEVICES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(DEFAULT_DEVICES)
}

/// What one round measured.
struct Measured {
    collection: f64,
    turnaround: f64,
    /// The largest RSS of the server (and the `confed-enclave` process) seen by the poller
    /// between the close and model version 1.
    peak_rss_mb: f64,
    /// CPU seconds each process (the server, then the `confed-enclave` process if any) spent
    /// between the poller seeing the close and model version 1.
    cpu: Vec<f64>,
}

/// A process's CPU time (user + system) in seconds, from /proc (0 where it is not there).
fn process_cpu_seconds(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .map_or(0.0, |stat| ticks(&stat) / 100.0)
}

/// utime + stime (fields 14 and 15, counted after the command's closing paren) of a stat line.
fn ticks(stat: &str) -> f64 {
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    fields.get(11..13).map_or(0.0, |f| {
        f.iter().filter_map(|t| t.parse::<f64>().ok()).sum()
    })
}

/// The server's resident set, in MB (0 where /proc is not there).
fn rss_mb(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// What a round is measured against, in GB/s of ciphertext, best of five on all cores (this
/// shared VM's neighbours slow single runs by up to half).
struct Reference {
    /// The aggregation benchmark's work on these bytes: `Aggregator` opening, checking, clipping
    /// and summing 48 updates drawn as the simulator draws them (uniform in +-0.01, L2 norm about
    /// 3). Like the aggregation benchmark's contributions/s, it leaves out the noise, a fixed
    /// cost per round (about 20 ms for this model) that the turnaround includes.
    alone: f64,
    /// The same with the two passes per byte a round cannot drop: each contribution read from a
    /// file in the page cache into the worker's own buffer (a TEE copies bytes the host can still
    /// change before it trusts them) and checked against its committed BLAKE3. No lease, key,
    /// noise, release or update: the most any round on this machine could reach.
    ceiling: f64,
}

fn aggregation_reference(clip_norm: f64) -> Reference {
    let (private, public) = generate_keypair();
    let model = encode_f32_tensors(&[("w", vec![PARAMS], &vec![0f32; PARAMS])]).unwrap();
    let schema = validate_model(&model).unwrap();
    let context = RoundContext {
        task_id: "reference".into(),
        round: 1,
        policy_sha256: "0".repeat(64),
        model_sha256: "1".repeat(64),
    };
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let contributions: Vec<(String, Option<Vec<u8>>)> = (0..48)
        .map(|i| {
            let values: Vec<f32> = (0..PARAMS)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    0.02 * ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
                })
                .collect();
            let update = encode_f32_tensors(&[("w", vec![PARAMS], &values)]).unwrap();
            let id = format!("assignment-{i}");
            let sealed = envelope::seal_with(
                &confed_enclave::hpke_awslc::AwsLc,
                &public,
                "reference-key",
                &context,
                &id.as_str().into(),
                &update,
            )
            .unwrap();
            (envelope::assignment_ref(&id), Some(sealed.to_cbor()))
        })
        .collect();
    let bytes: usize = contributions
        .iter()
        .map(|(_, b)| b.as_ref().map_or(0, Vec::len))
        .sum();
    let aggregator = || {
        let binding = Binding {
            context: context.clone(),
            key_id: "reference-key".into(),
            inputs_digest: "2".repeat(64),
        };
        Aggregator::new(binding, clip_norm, schema.clone(), &private).unwrap()
    };
    let included = |aggregator: &Aggregator| {
        assert_eq!(
            aggregator.counts(),
            (48, 0),
            "every reference update is included"
        )
    };
    let mut alone = f64::MAX;
    for _ in 0..5 {
        let started = Instant::now();
        let aggregator = aggregator();
        aggregator.add_batch(&contributions);
        alone = alone.min(started.elapsed().as_secs_f64());
        included(&aggregator);
    }
    let directory = tempfile::tempdir().unwrap();
    let files: Vec<(String, std::path::PathBuf, [u8; 32])> = contributions
        .iter()
        .enumerate()
        .map(|(i, (assignment_ref, bytes))| {
            let bytes = bytes.as_deref().unwrap();
            let path = directory.path().join(format!("{i}.envelope"));
            std::fs::write(&path, bytes).unwrap();
            (
                assignment_ref.clone(),
                path,
                *blake3::hash(bytes).as_bytes(),
            )
        })
        .collect();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let mut ceiling = f64::MAX;
    for _ in 0..5 {
        let started = Instant::now();
        let aggregator = aggregator();
        std::thread::scope(|scope| {
            for core in 0..cores {
                let (files, aggregator) = (&files, &aggregator);
                scope.spawn(move || {
                    let mut buffer = Vec::with_capacity(PARAMS * 4 + 4096);
                    for (assignment_ref, path, digest) in files.iter().skip(core).step_by(cores) {
                        use std::io::Read;
                        buffer.clear();
                        std::fs::File::open(path)
                            .unwrap()
                            .read_to_end(&mut buffer)
                            .unwrap();
                        assert_eq!(blake3::hash(&buffer).as_bytes(), digest);
                        aggregator.add(assignment_ref, Some(&buffer)).unwrap();
                    }
                });
            }
        });
        ceiling = ceiling.min(started.elapsed().as_secs_f64());
        included(&aggregator);
    }
    let gb = bytes as f64 / 1e9;
    Reference {
        alone: gb / alone,
        ceiling: gb / ceiling,
    }
}

/// This process's CPU time (user + system, all threads) in seconds.
fn cpu_seconds() -> f64 {
    process_cpu_seconds(std::process::id())
}

/// What moving `bytes` over loopback TCP costs this machine, with nothing else: one thread
/// writes 1 MB buffers to a socket, another reads them into one reused buffer (the least any
/// read over a network socket copies). Returns the CPU seconds both spent, best of three: the
/// floor a worker reading over the network adds to its open step when the sender shares its
/// cores, as `confed serve` does in this bench (on their own machines the worker pays only the
/// receiving half).
fn loopback_transfer_cpu(bytes: usize) -> f64 {
    use std::io::{Read, Write};
    let chunk = 1 << 20;
    let count = bytes.div_ceil(chunk);
    let mut best = f64::MAX;
    for _ in 0..3 {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let started = cpu_seconds();
        let sender = std::thread::spawn(move || {
            let (mut socket, _) = listener.accept().unwrap();
            let buffer = vec![7u8; chunk];
            for _ in 0..count {
                socket.write_all(&buffer).unwrap();
            }
        });
        let mut socket = std::net::TcpStream::connect(address).unwrap();
        let mut buffer = vec![0u8; chunk];
        for _ in 0..count {
            socket.read_exact(&mut buffer).unwrap();
        }
        sender.join().unwrap();
        best = best.min(cpu_seconds() - started);
    }
    best
}

#[path = "support/process.rs"]
mod process;
use process::{Server, WorkerKind, binary, start_with};

/// A safetensors file with one F32 tensor `w` of `PARAMS` zeros.
fn model() -> Vec<u8> {
    let header = format!(
        r#"{{"w":{{"dtype":"F32","shape":[{PARAMS}],"data_offsets":[0,{}]}}}}"#,
        PARAMS * 4
    );
    let padded = header.len().div_ceil(8) * 8;
    let mut bytes = (padded as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(8 + padded, b' ');
    bytes.resize(8 + padded + PARAMS * 4, 0);
    bytes
}

/// The benchmark's task: one round of `devices` contributions, all of them needed.
fn spec(population: &str, devices: usize, clip_norm: f64) -> serde_json::Value {
    serde_json::json!({
        "population": population,
        "rounds": 1,
        "report_goal": devices,
        "min_reports": devices,
        "round_deadline_seconds": 3600,
        "assignment_timeout_seconds": 600,
        "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": clip_norm},
        // Devices send within 50 ms of their assignment: the collection is not what is measured
        // (without it they would wait one to two `device_seconds_per_round`).
        "upload_window": {"start_ms": 0, "end_ms": 50},
        "plan": {"epochs": 1, "batch_size": 32, "learning_rate": 0.1},
    })
}

/// `devices` simulated devices of `population` (a second process, `--no-train`) fill the round,
/// with tokens of `issuer` (its URL) when the task requires them; returns how long they took.
async fn simulate(server: &Server, population: &str, devices: usize, issuer: Option<&str>) -> f64 {
    let started = Instant::now();
    let mut command = tokio::process::Command::new(binary());
    command.args(["devices", "simulate", "--server", &server.url]);
    if let Some(issuer) = issuer {
        command.args(["--issuer", issuer]);
    }
    let output = command
        .args([
            "--population",
            population,
            "--devices",
            &devices.to_string(),
        ])
        .args([
            "--concurrency",
            "32",
            "--trust",
            &server.trust,
            "--no-train",
        ])
        // Timed: no settling check after the last device (the bench reads the task itself).
        .args(["--max-retry-wait-ms", "50", "--settle-ms", "0"])
        .env("RUST_LOG", "error")
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    started.elapsed().as_secs_f64()
}

/// One round of `devices` 1 MB contributions of the task `spec` (`spec()`, perhaps with more
/// fields); its devices trust `issuer` when it requires tokens.
async fn round(
    http: &reqwest::Client,
    server: &Server,
    (population, spec): (&str, serde_json::Value),
    devices: usize,
    issuer: Option<&str>,
) -> Measured {
    let task = server.open_task(http, spec, model()).await;
    // A poller watches the round: the first time it is seen out of COLLECTING is its close, the
    // first time model version 1 is readable the end of the turnaround (both to within the 5 ms
    // poll and one loopback request).
    let watcher = {
        let (http, url, token, task, pid) = (
            http.clone(),
            server.url.clone(),
            server.token.clone(),
            task.clone(),
            std::iter::once(server.child.id())
                .chain(server.worker.as_ref().map(std::process::Child::id))
                .collect::<Vec<u32>>(),
        );
        tokio::spawn(async move {
            let get = |path: String| {
                let request = http.get(format!("{url}{path}")).bearer_auth(&token);
                async move {
                    request
                        .send()
                        .await
                        .unwrap()
                        .json::<serde_json::Value>()
                        .await
                        .unwrap()
                }
            };
            let deadline = Instant::now() + Duration::from_secs(3600);
            let mut closed = None;
            let mut peak_rss_mb = 0f64;
            let cpu = || {
                pid.iter()
                    .map(|&p| process_cpu_seconds(p))
                    .collect::<Vec<f64>>()
            };
            let mut cpu_at_close = Vec::new();
            loop {
                if closed.is_none() {
                    let rounds = get(format!("/v1/tasks/{task}/rounds")).await;
                    if rounds["rounds"][0]["state"].as_str() != Some("COLLECTING") {
                        closed = Some(Instant::now());
                        cpu_at_close = cpu();
                    }
                }
                if let Some(closed) = closed {
                    peak_rss_mb = peak_rss_mb.max(pid.iter().map(|&p| rss_mb(p)).sum());
                    let state = get(format!("/v1/tasks/{task}")).await;
                    if state["model_version"].as_i64() == Some(1) {
                        let spent = cpu()
                            .iter()
                            .zip(&cpu_at_close)
                            .map(|(a, b)| a - b)
                            .collect();
                        return (closed.elapsed().as_secs_f64(), peak_rss_mb, spent);
                    }
                }
                assert!(Instant::now() < deadline, "no model version 1");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let collection = simulate(server, population, devices, issuer).await;
    let (turnaround, peak_rss_mb, cpu) = watcher.await.unwrap();
    Measured {
        collection,
        turnaround,
        peak_rss_mb,
        cpu,
    }
}

#[path = "support/partitioned.rs"]
mod partitioned;

#[path = "support/masked_round.rs"]
mod masked_round;

/// Who aggregates the bench's rounds: `CONFED_BENCH_WORKER=inprocess` or `remote` for one of
/// them, otherwise both, each case in process and then remote.
fn worker_kinds() -> Vec<WorkerKind> {
    match std::env::var("CONFED_BENCH_WORKER").as_deref() {
        Ok("remote") => vec![WorkerKind::Remote],
        Ok("inprocess") => vec![WorkerKind::InProcess],
        _ => vec![WorkerKind::InProcess, WorkerKind::Remote],
    }
}

fn kind_name(kind: WorkerKind) -> &'static str {
    match kind {
        WorkerKind::Remote => "remote worker",
        _ => "in-process worker",
    }
}

/// One case's round on a fresh server aggregated by `kind`: prints its figures and returns its
/// open step and the worker's CPU during the turnaround (the server's for the in-process worker,
/// the `confed-enclave` process's for the remote one), in seconds.
async fn measured_case(
    http: &reqwest::Client,
    (label, population, clip_norm): (&str, &str, f64),
    kind: WorkerKind,
    devices: usize,
) -> (f64, f64) {
    // A server (and data directory) per round: each is deleted before the next starts, so a
    // 10 GB round's cases need the disk of one.
    let server = start_with(kind);
    let population = format!("{population}-{}", kind_name(kind).replace(' ', "-"));
    let m = round(
        http,
        &server,
        (&population, spec(&population, devices, clip_norm)),
        devices,
        None,
    )
    .await;
    let job = server.jobs.recv_timeout(Duration::from_secs(10)).ok();
    let (seconds, open) = job
        .as_ref()
        .map_or((f64::NAN, f64::NAN), |job| (job.seconds, job.step("open")));
    let reference = aggregation_reference(clip_norm);
    let bytes = (devices * (PARAMS * 4 + 200)) as f64 / 1e9;
    let gbps = bytes / m.turnaround;
    println!(
        "{label}, {}: collection {:.2} s ({:.0} cycles/s), turnaround {:.2} s ({gbps:.2} GB/s; job {seconds:.2} s, open step {open:.3} s ({:.2} GB/s), before the job {:.3} s), peak RSS {:.0} MB | aggregation alone {:.2} GB/s, turnaround at {:.2} of it | read + digest check + aggregation, no fixed steps (a round's ceiling) {:.2} GB/s, turnaround at {:.2} of it",
        kind_name(kind),
        m.collection,
        devices as f64 / m.collection,
        m.turnaround,
        bytes / open,
        m.turnaround - seconds,
        m.peak_rss_mb,
        reference.alone,
        gbps / reference.alone,
        reference.ceiling,
        gbps / reference.ceiling,
    );
    if let Some(job) = job {
        println!("  steps: {}", job.phases);
    }
    let cpu: Vec<String> = ["server", "confed-enclave"]
        .iter()
        .zip(&m.cpu)
        .map(|(name, seconds)| format!("{name} {seconds:.2} s"))
        .collect();
    println!("  CPU during the turnaround: {}", cpu.join(", "));
    (open, m.cpu.last().copied().unwrap_or(f64::NAN))
}

fn main() {
    let devices = devices();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    if let Some(workers) = partitioned::workers() {
        runtime.block_on(partitioned::run(devices, workers));
        return;
    }
    if std::env::var_os("CONFED_BENCH_MASKED").is_some() {
        runtime.block_on(masked_round::run(devices));
        return;
    }
    let kinds = worker_kinds();
    runtime.block_on(async {
        let http = confed_protocol::http::client(Duration::from_secs(60));
        println!(
            "== whole rounds: {devices} devices x 1 MB ({PARAMS} f32), confed serve (embedded), {}, aggregated by {}",
            binary(),
            kinds
                .iter()
                .map(|&kind| match kind {
                    WorkerKind::Remote =>
                        "a confed-enclave process over the worker API (the remote worker)",
                    _ => "the server's in-process worker",
                })
                .collect::<Vec<_>>()
                .join(", then ")
        );
        let mut opens = vec![Vec::new(); kinds.len()];
        let mut worker_cpu = vec![Vec::new(); kinds.len()];
        for case in [
            ("below the clip norm (clip 10)", "round-unclipped", 10.0),
            // The updates' norms spread narrowly around sqrt(262,144 x 0.01^2 / 3) = 2.956: at
            // that clip norm about half of them lie above it, as with a clip norm set at the
            // median norm.
            ("half above the clip norm (clip 2.956)", "round-half", 2.956),
            ("above the clip norm (clip 1)", "round-clipped", 1.0),
        ] {
            for (index, &kind) in kinds.iter().enumerate() {
                let (open, cpu) = measured_case(&http, case, kind, devices).await;
                opens[index].push(open);
                worker_cpu[index].push(cpu);
            }
        }
        if let [in_process, remote] = &opens[..] {
            let total = |opens: &[f64]| opens.iter().sum::<f64>();
            // The best a worker reading over loopback TCP can do on these cores: the in-process
            // open step plus the transfer's CPU spread over the cores (the in-process step's own
            // file read, a copy out of the page cache, left in as if it cost nothing here).
            let cores = std::thread::available_parallelism().map_or(1, usize::from) as f64;
            let transfer = loopback_transfer_cpu(devices * (PARAMS * 4 + 200));
            let floor = total(in_process) / 3.0 + transfer / cores;
            let per_case: Vec<String> = in_process
                .iter()
                .zip(remote)
                .map(|(local, remote)| format!("{:.2}", local / remote))
                .collect();
            println!(
                "remote worker at {:.2} of in-process (open step, {:.3} s against {:.3} s over the three cases; per case {}; goal: at least 0.9)",
                total(in_process) / total(remote),
                total(remote),
                total(in_process),
                per_case.join(", ")
            );
            println!(
                "loopback TCP alone moves these bytes with {transfer:.3} s of CPU (sender and receiver): on {cores} shared cores a remote worker's open step takes at least {floor:.3} s, at most {:.2} of in-process",
                total(in_process) / 3.0 / floor
            );
            println!(
                "the remote worker's own CPU in the turnaround at {:.2} of the in-process server's ({:.2} s against {:.2} s over the three cases): the ratio on machines of their own, where the server's sending is not the enclave's",
                total(&worker_cpu[0]) / total(&worker_cpu[1]),
                total(&worker_cpu[1]),
                total(&worker_cpu[0])
            );
        }
    });
}
