//! `confed devices simulate`: N simulated devices that really train (or, with `--no-train`, send
//! random updates of the model's shape as fast as allowed: the load generator), with progress bars
//! and a summary of outcomes and per-call latency.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use super::analytics_population::AnalyticsPopulation;
use super::train::{Plan, Rng, Softmax, Synthetic};
use confed_device::{Checkin, DeviceClient, DeviceError, ReportOutcome, Trained, TrustConfig};

#[derive(Debug, Clone)]
pub struct SimulationConfig {
    pub server: String,
    pub population: String,
    pub devices: usize,
    /// Index of the first simulated device: devices are `first_device..first_device + devices`,
    /// each with its own data shard, so several runs can draw different devices of one
    /// population.
    pub first_device: u64,
    pub concurrency: usize,
    /// Contributions per device before it stops.
    pub rounds: usize,
    pub trust: TrustConfig,
    pub train: bool,
    pub seed: u64,
    pub rows_per_device: usize,
    /// Cap on how long a device waits when told to retry (real devices wait the whole window).
    pub max_retry_wait: Duration,
    /// Consecutive retries after which a device gives up.
    pub idle_limit: usize,
    pub client_version: String,
    pub progress: bool,
    /// Draw the bars into this group (a caller showing its own bars), else into a new one.
    pub bars: Option<MultiProgress>,
    /// Where each device keeps the rounds it served and the evaluations it granted
    /// (`device-<index>.json`), so a simulation run again over the same devices remembers them
    /// as real devices do. `None`: in memory only (the device library warns once): right for a
    /// load generator, wrong for anything that restarts devices of a DP-FTRL task.
    pub state_dir: Option<std::path::PathBuf>,
    /// The devices' records for analytics tasks (`None`: the default population). A device
    /// whose assignment's policy names a query answers it from these instead of training.
    pub analytics: Option<AnalyticsPopulation>,
}

/// Latencies of one kind of call.
#[derive(Debug, Default, Clone)]
pub struct Latencies(Vec<Duration>);

impl Latencies {
    fn percentile(&self, p: usize) -> Duration {
        let mut sorted = self.0.clone();
        sorted.sort();
        sorted
            .get((sorted.len() * p / 100).min(sorted.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    }
}

#[derive(Debug, Default, Clone)]
pub struct Summary {
    pub contributions: usize,
    pub declined: usize,
    /// Uploads refused because the round had closed meanwhile (its goal reached by other
    /// devices: over-selection at work, not a failure).
    pub late: usize,
    pub failures: Vec<String>,
    /// Updates sent as zeros because training or evaluation failed on the device (the server saw
    /// an ordinary completed contribution), with the device's own reasons.
    pub zeroed: Vec<String>,
    pub retries: BTreeMap<String, usize>,
    pub calls: BTreeMap<&'static str, Latencies>,
    pub elapsed: Duration,
    /// Accuracy of the last downloaded model on a held-out test set (training mode).
    pub model_accuracy: Option<f64>,
    /// Each contribution's send instant as drawn and as kept (docs/privacy.md, "Time").
    pub sends: Vec<SendTiming>,
    /// Devices that made their `rounds` contributions.
    pub finished_devices: usize,
    /// Devices that stopped after `idle_limit` answers in a row with no work for them.
    pub idle_devices: usize,
}

/// When one contribution was sent: its send instant, drawn before training, in ms after the
/// device received the assignment, and how far past that instant the seal started (scheduling
/// jitter: whatever training did, the device waits for the instant).
#[derive(Debug, Clone, Copy)]
pub struct SendTiming {
    pub drawn_ms: i64,
    pub started_late_by: Duration,
}

impl Summary {
    pub fn print(&self) {
        self.print_calls();
        if !self.zeroed.is_empty() {
            println!(
                "updates sent as zeros (training failed or late on the device; the server saw ordinary completions): {}",
                self.zeroed.len()
            );
            for problem in self.zeroed.iter().take(5) {
                println!("zeroed: {problem}");
            }
        }
    }

    /// Where the send instants fell and how closely they were kept (docs/privacy.md, "Time").
    pub fn send_instants(&self) -> Option<String> {
        let drawn = self.sends.iter().map(|s| s.drawn_ms);
        let (first, last) = (drawn.clone().min()?, drawn.max()?);
        let latest = self
            .sends
            .iter()
            .map(|s| s.started_late_by)
            .max()
            .unwrap_or_default();
        Some(format!(
            "send instants: {} drawn {first}-{last} ms after their assignments, before training; every seal started at most {:.1} ms after its instant",
            self.sends.len(),
            latest.as_secs_f64() * 1e3
        ))
    }

    /// `print` without the zero updates: for a load generator whose devices send at once, before
    /// anything could be ready.
    pub fn print_without_zeroed(&self) {
        self.print_calls();
    }

    fn print_calls(&self) {
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        println!(
            "contributions: {}  declined (already contributed): {}  late (round closed first): {}  failures: {}  elapsed: {:.2} s  cycles/s: {:.1}",
            self.contributions,
            self.declined,
            self.late,
            self.failures.len(),
            secs,
            self.contributions as f64 / secs
        );
        for (reason, count) in &self.retries {
            println!("retry windows: {reason}: {count}");
        }
        for (call, latencies) in &self.calls {
            println!(
                "{call:<10} n={:<6} p50 {:>7.2} ms  p99 {:>7.2} ms",
                latencies.0.len(),
                latencies.percentile(50).as_secs_f64() * 1e3,
                latencies.percentile(99).as_secs_f64() * 1e3
            );
        }
        if let Some(line) = self.send_instants() {
            println!("{line}");
        }
        if let Some(accuracy) = self.model_accuracy {
            println!(
                "accuracy of the served model on held-out data: {:.1} %",
                accuracy * 100.0
            );
        }
        for failure in self.failures.iter().take(5) {
            println!("failure: {failure}");
        }
    }
}

struct Shared {
    config: SimulationConfig,
    http: reqwest::Client,
    /// Simulated devices share checked key entries (each real device checks a key once).
    verified: confed_device::VerifiedKeys,
    task: Synthetic,
    summary: Mutex<Summary>,
    contributions: ProgressBar,
}

impl Shared {
    fn timed(&self, call: &'static str, started: Instant) {
        if let Ok(mut summary) = self.summary.lock() {
            summary
                .calls
                .entry(call)
                .or_default()
                .0
                .push(started.elapsed());
        }
    }

    fn note(&self, update: impl FnOnce(&mut Summary)) {
        if let Ok(mut summary) = self.summary.lock() {
            update(&mut summary);
        }
    }
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// A random update with the model's tensors, names and shapes (load generation), from the shape
/// the device already read off the model.
fn random_update(shape: &confed_device::UpdateShape, rng: &mut Rng) -> Result<Vec<u8>, String> {
    let values: Vec<Vec<f32>> = shape
        .tensors()
        .iter()
        .map(|(_, dims)| {
            let n: usize = dims.iter().product();
            // Uniform noise: cheap, so the generator does not steal CPU from the server it measures.
            (0..n).map(|_| 0.02 * (rng.uniform() - 0.5)).collect()
        })
        .collect();
    let tensors: Vec<(&str, Vec<usize>, &[f32])> = shape
        .tensors()
        .iter()
        .zip(&values)
        .map(|((name, dims), v)| (name.as_str(), dims.clone(), v.as_slice()))
        .collect();
    confed_worker_api::model::encode_f32_tensors(&tensors).map_err(|e| e.to_string())
}

/// A simulated device's rows: what it trains on and what it evaluates models on.
struct LocalData {
    train: super::train::Dataset,
    held_out: super::train::Dataset,
}

/// One device until it has contributed `rounds` times or was told to retry `idle_limit` times in a row.
async fn device(shared: Arc<Shared>, index: u64) {
    let config = &shared.config;
    let client = match DeviceClient::with_shared(
        shared.http.clone(),
        &config.server,
        &config.trust,
        shared.verified.clone(),
    ) {
        // Simulated devices seal with AWS-LC: in a load generator sharing the server's cores,
        // RustCrypto's X25519 was ~30 % of the simulator's CPU.
        Ok(client) => {
            let client = client.with_sealer(Arc::new(confed_enclave::hpke_awslc::AwsLc));
            // A simulated device has no hardware to attest with: where its trust lists token
            // issuers it uses the dev attestation, which only a dev issuer accepts.
            let client = if config.trust.token_issuers.is_empty() {
                client
            } else {
                match confed_device::DevAttestation::generate() {
                    Ok(attestation) => client.with_attestation(Arc::new(attestation)),
                    Err(e) => {
                        return shared.note(|s| {
                            s.failures
                                .push(format!("device {index}: {}", e.with_causes()))
                        });
                    }
                }
            };
            match &config.state_dir {
                None => client,
                Some(dir) => {
                    let store =
                        confed_device::FileStore::new(dir.join(format!("device-{index}.json")));
                    match client.with_state(Arc::new(store)) {
                        Ok(client) => client,
                        Err(e) => {
                            return shared.note(|s| {
                                s.failures
                                    .push(format!("device {index}: {}", e.with_causes()))
                            });
                        }
                    }
                }
            }
        }
        Err(e) => {
            return shared.note(|s| {
                s.failures
                    .push(format!("device {index}: {}", e.with_causes()))
            });
        }
    };
    let shard = config.train.then(|| {
        Arc::new(LocalData {
            train: shared.task.shard(index, config.rows_per_device),
            held_out: shared
                .task
                .held_out(index, (config.rows_per_device / 2).max(1)),
        })
    });
    let mut rng = Rng::new(config.seed ^ index);
    let attributes = simulated_attributes();
    let (mut contributed, mut idle) = (0, 0);
    while contributed < config.rounds && idle < config.idle_limit {
        let started = Instant::now();
        let answer = client
            .checkin(&config.population, &config.client_version, &attributes)
            .await;
        shared.timed("checkin", started);
        let assignment = match answer {
            Err(e) => {
                shared.note(|s| {
                    s.failures
                        .push(format!("device {index}: check-in: {}", e.with_causes()))
                });
                idle += 1;
                continue;
            }
            Ok(Checkin::Retry(retry)) => {
                idle += 1;
                shared.note(|s| *s.retries.entry(retry.reason.clone()).or_default() += 1);
                let wait = retry
                    .retry_window
                    .jittered(f64::from(rng.uniform()))
                    .min(config.max_retry_wait);
                tokio::time::sleep(wait).await;
                continue;
            }
            Ok(Checkin::Assigned(assignment)) => assignment,
        };
        if client.declines(&assignment).is_some() {
            // Declining counts as idle: the device has nothing to give this round.
            idle += 1;
            let declined = client
                .report(&assignment, ReportOutcome::NotEligible, None)
                .await;
            shared.note(|s| s.declined += 1);
            // The server cannot tell this device from a fresh one and would offer the same round
            // again at once: wait as the answer says before checking in again.
            if let Some(window) = declined.ok().and_then(|answer| answer.retry_window) {
                let wait = window
                    .jittered(f64::from(rng.uniform()))
                    .min(config.max_retry_wait);
                tokio::time::sleep(wait).await;
            }
            continue;
        }
        // Idle again only after a contribution or a late one: failures in a row add up.
        match cycle(
            &shared,
            &client,
            &assignment,
            shard.as_ref(),
            index,
            &mut rng,
        )
        .await
        {
            Ok(()) => {
                idle = 0;
                contributed += 1;
                shared.note(|s| s.contributions += 1);
                shared.contributions.inc(1);
            }
            // The round reached its goal with other devices' uploads first: what an
            // over-selected round is for. Not a failure, and nothing to report. (An expired
            // assignment is also 410, and is a failure: the device was too slow.)
            Err(DeviceError::Server {
                status: 410,
                detail,
            }) if detail.contains("round is closed") => {
                idle = 0;
                shared.note(|s| s.late += 1)
            }
            Err(e) => {
                let _ = client
                    .report(&assignment, ReportOutcome::Failed, Some(&e.with_causes()))
                    .await;
                shared.note(|s| {
                    s.failures
                        .push(format!("device {index}: {}", e.with_causes()))
                });
                // Not progress: wait before the next check-in, never loop on a failure.
                idle += 1;
                let wait = confed_device::tokens::AFTER_FAILURE
                    .jittered(f64::from(rng.uniform()))
                    .min(config.max_retry_wait);
                tokio::time::sleep(wait).await;
            }
        }
    }
    match contributed >= config.rounds {
        true => shared.note(|s| s.finished_devices += 1),
        false => shared.note(|s| s.idle_devices += 1),
    }
}

async fn cycle(
    shared: &Shared,
    client: &DeviceClient,
    assignment: &crate::api::devices::AssignmentResponse,
    shard: Option<&Arc<LocalData>>,
    index: u64,
    rng: &mut Rng,
) -> Result<(), DeviceError> {
    // Accepting the assignment: the checks and the download depend on the policy, the key and
    // the model (the same for every device of the round), never on this device's data, so a
    // refusal here may be reported with its reason.
    let public_key = client.verified_key(assignment, unix_now())?;
    let policy = client.accepted_policy(assignment, &shared.config.population)?;
    // When this device asks for its token and when it sends: drawn before anything reads its
    // data (docs/privacy.md, "Time").
    let schedule = client.schedule(assignment, &policy)?;
    let started = Instant::now();
    let model = client.model(assignment).await?;
    shared.timed("model", started);
    if let Some(query) = policy.policy.analytics.clone() {
        let population = shared.config.analytics.clone().unwrap_or_default();
        let records = population.records(&query, index, shared.config.seed);
        let answering = schedule.answer_until(&query, records);
        let keyed = (&public_key, &schedule, &policy, &model);
        return send_at_instant(shared, client, assignment, keyed, answering).await;
    }
    let shape = model.update_shape(&policy)?;
    // From here on, nothing the server hears depends on what training does, nor when: a
    // failure, a NaN, the wrong tensors or training still running at the send instant become a
    // zero update of the model's shape, sealed, uploaded and reported `completed` like any other
    // at the drawn instant (docs/privacy.md, "What leaves a device").
    let evaluation = client.evaluation_for(assignment, &policy);
    let train = trainer(&model, &policy, shard.cloned(), evaluation, &shape, rng);
    let training = async {
        Ok(schedule
            .train_until(&shape, evaluation.is_some(), train)
            .await)
    };
    let keyed = (&public_key, &schedule, &policy, &model);
    send_at_instant(shared, client, assignment, keyed, training).await
}

/// An accepted assignment: the checked key, its schedule, the policy and the model.
type Accepted<'a> = (
    &'a confed_device::PublicKey,
    &'a confed_device::Schedule,
    &'a confed_device::AcceptedPolicy,
    &'a confed_device::Model,
);

/// What a device does once it has accepted an assignment and started its work (`due`: training,
/// or an analytics answer): asks for its token at the token instant, and at the send instant
/// seals whatever is due, uploads it and reports.
async fn send_at_instant(
    shared: &Shared,
    client: &DeviceClient,
    assignment: &crate::api::devices::AssignmentResponse,
    (public_key, schedule, policy, model): Accepted<'_>,
    due: impl std::future::Future<
        Output = Result<confed_device::DueUpdate, confed_device::AnalyticsError>,
    >,
) -> Result<(), DeviceError> {
    let token = async {
        schedule.token_due().await;
        let started = Instant::now();
        let token = client.token_for(assignment, policy, model).await;
        if matches!(token, Ok(Some(_))) {
            shared.timed("token", started);
        }
        token
    };
    let (token, due) = tokio::join!(token, due);
    let due = due.map_err(|e| DeviceError::Training(e.to_string()))?;
    let times = schedule.times();
    let timing = SendTiming {
        drawn_ms: times.send_ms - times.received_ms,
        started_late_by: tokio::time::Instant::now().saturating_duration_since(schedule.send_at()),
    };
    shared.note(|s| s.sends.push(timing));
    let token = token?;
    let started = Instant::now();
    let sent = client
        .send(assignment, public_key, policy, model, &due, token)
        .await;
    // Noted after the send: the zero path must do nothing more than the trained one before it.
    if !due.problems().is_empty() {
        let problems: Vec<String> = due.problems().iter().map(|p| p.to_string()).collect();
        shared.note(|s| s.zeroed.push(problems.join("; ")));
    }
    sent?;
    shared.timed("send", started);
    Ok(())
}

/// What the device runs on its training thread: softmax training on its shard (with the round's
/// metrics when it evaluates), or, without data (`--no-train`), a random update of the model's
/// shape drawn now.
fn trainer(
    model: &confed_device::Model,
    policy: &confed_device::AcceptedPolicy,
    shard: Option<Arc<LocalData>>,
    evaluation: Option<confed_device::Evaluation>,
    shape: &confed_device::UpdateShape,
    rng: &mut Rng,
) -> impl FnOnce(&confed_device::Cancel) -> Trained + Send + 'static {
    let random = shard.is_none().then(|| random_update(shape, rng));
    let (bytes, policy) = (model.bytes.clone(), policy.clone());
    move |cancel| match (shard, random) {
        (Some(data), _) => {
            // Read once: training starts from it and evaluation measures it.
            let base = Softmax::from_safetensors(&bytes).map_err(|e| e.with_causes());
            let metrics = evaluation.map(|e| match (&base, cancel.is_cancelled()) {
                (_, true) => Err("the send instant passed".to_string()),
                (Ok(base), false) => Ok(base.evaluate(&data.held_out, e.max_loss)),
                (Err(e), false) => Err(e.clone()),
            });
            let update = base.and_then(|base| train_softmax(base, &policy, &data.train, cancel));
            // What a weighting policy weighs the update by (ignored otherwise).
            let examples = Some(data.train.len() as f64);
            Trained {
                update,
                metrics,
                examples,
            }
        }
        (None, random) => Trained {
            update: random.unwrap_or_else(|| Err("no update".into())),
            metrics: evaluation.map(|_| Ok([0.0; 3])),
            // A random update stands for one example.
            examples: Some(1.0),
        },
    }
}

/// One device's local training of the softmax model on its shard, as the update's safetensors
/// (the new weights minus the model's), or why it could not train. Stops between batches once
/// the send instant has passed (what it would give then is not sent).
fn train_softmax(
    base: Softmax,
    policy: &confed_device::AcceptedPolicy,
    shard: &super::train::Dataset,
    cancel: &confed_device::Cancel,
) -> Result<Vec<u8>, String> {
    if base.features != shard.features || base.classes != shard.classes {
        return Err(format!(
            "the model is {}x{} but the data set has {} classes of {} features",
            base.classes, base.features, shard.classes, shard.features
        ));
    }
    // The plan the device agreed to: the policy's, not the assignment's loose copy.
    let plan = Plan::from_json(
        &serde_json::from_str(&policy.policy.plan).unwrap_or(serde_json::Value::Null),
    );
    let mut local = base.clone();
    local.train_until(
        shard,
        plan.epochs,
        plan.batch_size,
        plan.learning_rate,
        || cancel.is_cancelled(),
    );
    Ok(local.delta_from(&base).to_safetensors())
}

/// Runs the simulation and returns its summary.
pub async fn run(config: SimulationConfig) -> Result<Summary, DeviceError> {
    // Fail early on a bad trust configuration or state directory, before any device starts.
    DeviceClient::new(&config.server, &config.trust)?;
    if let Some(dir) = &config.state_dir {
        std::fs::create_dir_all(dir).map_err(|source| {
            DeviceError::State(confed_device::StateError::Write {
                path: dir.display().to_string(),
                source,
            })
        })?;
    }
    let bars = config.bars.clone().unwrap_or_default();
    if !config.progress {
        bars.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let style = ProgressStyle::with_template("{prefix:>14} [{bar:40}] {pos}/{len} {msg}")
        .expect("static template")
        .progress_chars("=> ");
    let devices_bar = bars.add(
        ProgressBar::new(config.devices as u64)
            .with_style(style.clone())
            .with_prefix("devices done"),
    );
    let contributions = bars.add(
        ProgressBar::new((config.devices * config.rounds) as u64)
            .with_style(style)
            .with_prefix("contributions"),
    );
    let shared = Arc::new(Shared {
        task: Synthetic::standard(config.seed),
        http: confed_protocol::http::client(Duration::from_secs(30)),
        verified: Default::default(),
        summary: Mutex::default(),
        contributions,
        config: config.clone(),
    });
    let started = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let workers: Vec<_> = (0..config.concurrency.max(1))
        .map(|_| {
            let (shared, next, bar) = (shared.clone(), next.clone(), devices_bar.clone());
            tokio::spawn(async move {
                loop {
                    let index = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if index >= shared.config.devices as u64 {
                        break;
                    }
                    device(shared.clone(), shared.config.first_device + index).await;
                    bar.inc(1);
                }
            })
        })
        .collect();
    for worker in workers {
        let _ = worker.await;
    }
    devices_bar.finish();
    shared.contributions.finish();
    let mut summary = shared.summary.lock().map(|s| s.clone()).unwrap_or_default();
    summary.elapsed = started.elapsed();
    Ok(summary)
}

/// The shape of the synthetic task's model: upload a zero model of this shape to run a
/// simulation (`confed devices init-model`).
pub fn initial_model(seed: u64) -> Vec<u8> {
    let task = Synthetic::standard(seed);
    Softmax::zeros(task.classes, task.features).to_safetensors()
}

/// What every simulated device reports at check-in: a charging Android phone on an unmetered
/// network with 8 GB of RAM.
pub(crate) fn simulated_attributes() -> confed_protocol::device::Attributes {
    use confed_protocol::device::Attribute;
    [
        ("os", Attribute::Text("android".into())),
        ("ram_gb", Attribute::Number(8.0)),
        ("charging", Attribute::Flag(true)),
        ("unmetered", Attribute::Flag(true)),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_string(), value))
    .collect()
}
