//! `confed demo`: the embedded system end to end in one command. Three key services (threshold 2)
//! with the DEV attester, the APIs, the scheduler and an enclave worker start in-process; a
//! partner task trains softmax regression on a synthetic, non-IID classification task held by a
//! few hundred simulated devices; after each round the demo prints what the enclave released
//! (contributions, privacy spent) and the new global model's accuracy on held-out data.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use serde_json::{Value, json};
use thiserror::Error;

use crate::clock::SystemClock;
use crate::embedded::{EmbeddedOptions, EmbeddedSystem};
use crate::tools::simulate::{self, SimulationConfig};
use crate::tools::train::{Softmax, Synthetic};

#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Devices in the population.
    pub devices: usize,
    pub rounds: u32,
    /// Devices per round.
    pub report_goal: u32,
    pub epsilon: f64,
    pub delta: f64,
    pub clip_norm: f64,
    pub seed: u64,
    pub optimizer: confed_worker_api::optimizer::ServerOptimizer,
    pub server_learning_rate: f64,
    /// The noise: the Gaussian mechanism, or DP-FTRL with tree aggregation or BLT noise, whose
    /// minimum separation is the round-robin's period (`devices / report_goal` rounds, at most
    /// the task's rounds).
    pub noise: DemoNoise,
    /// Adaptive clipping with its defaults, from `clip_norm`.
    pub adaptive_clipping: bool,
    /// Federated evaluation every this many rounds (each device on 20 held-out examples, the
    /// noise at its default), charged to the budget.
    pub evaluate_every: Option<u32>,
    /// The evaluation's noise in examples (default: the API's, the least noise costing at most 10 % of the budget).
    pub evaluation_stddev: Option<f64>,
    pub data_dir: PathBuf,
    pub progress: bool,
    /// The task requires device tokens from an in-process DEV issuer (dev attester).
    pub device_auth: bool,
    /// The noised health signal, at its default noise (`privacy.health: {}`).
    pub health: bool,
    /// Masks beneath the enclave (docs/secure-aggregation.md): devices clip and mask their
    /// updates with seeds only the key services hold; implies `device_auth`.
    pub secure_aggregation: bool,
    /// With `secure_aggregation`: the key services add the round's noise (docs/secure-
    /// aggregation.md, "Distributed noise"); the Gaussian mechanism only.
    pub distributed_noise: bool,
    /// Loopback ports for the demo's listeners (API, key services, issuer; default: any free).
    pub ports: Option<crate::ports::PortRange>,
}

/// `DemoOptions::noise`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DemoNoise {
    Gaussian,
    Tree,
    Blt,
}

#[derive(Debug, Error)]
pub enum DemoError {
    #[error("{step}")]
    Setup {
        step: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("the API refused: {0}")]
    Api(String),
    #[error("round {round} did not complete within {seconds} s (state: {state})")]
    Stalled {
        round: u32,
        seconds: u64,
        state: String,
    },
    #[error("devices")]
    Devices(#[from] confed_device::DeviceError),
    #[error("a device failed: {0}")]
    DeviceFailed(String),
    #[error("{0}")]
    Options(String),
}

/// A `DemoError::Setup` for `step`, keeping the cause.
fn setup(step: &'static str) -> impl FnOnce(Box<dyn std::error::Error + Send + Sync>) -> DemoError {
    move |source| DemoError::Setup { step, source }
}

pub(super) fn api(e: impl std::fmt::Display) -> DemoError {
    DemoError::Api(e.to_string())
}

/// Creates a task from `request` (`POST /v1/tasks`) as the tenant `token`; its id.
pub(super) async fn create_task(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    request: &Value,
) -> Result<String, DemoError> {
    let created = http
        .post(format!("{url}/v1/tasks"))
        .bearer_auth(token)
        .json(request)
        .send()
        .await
        .map_err(api)?;
    if !created.status().is_success() {
        return Err(api(created.text().await.unwrap_or_default()));
    }
    let task: Value = created.json().await.map_err(api)?;
    Ok(task["id"].as_str().unwrap_or_default().to_string())
}

/// Accuracy after each round (index 0: the initial model).
#[derive(Debug, Clone)]
pub struct DemoSummary {
    pub accuracy: Vec<f64>,
    /// The clip norm each round used (its release manifest's).
    pub clip_norms: Vec<f64>,
    /// Each evaluation the devices made, as released.
    pub evaluations: Vec<crate::db::EvaluationPoint>,
    pub epsilon_spent: f64,
    pub elapsed: Duration,
    /// Each round's authenticated contributions (the manifest's `authenticated`).
    pub authenticated: Vec<Option<u64>>,
    /// Each round's release manifest, as stored (and verified).
    pub manifests: Vec<confed_worker_api::Manifest>,
}

const ROUND_TIMEOUT: Duration = Duration::from_secs(300);
/// Held-out examples per device (it trains on twice as many).
const HELD_OUT_ROWS: usize = 20;

/// The demo task's upload window, in ms after an assignment: where each device's send instant
/// falls (every device of a round waits at once, so a round takes about its end).
const DEMO_WINDOW_MS: (u32, u32) = (300, 600);

impl DemoOptions {
    /// Refuses options that cannot make the run their header would announce, before anything
    /// starts.
    pub fn check(&self) -> Result<(), DemoError> {
        let refuse = |why: String| Err(DemoError::Options(why));
        if self.rounds == 0 || self.report_goal == 0 || self.devices == 0 {
            return refuse(
                "--devices, --rounds and --report-goal must each be at least 1".to_string(),
            );
        }
        if self.report_goal as usize > self.devices {
            return refuse(format!(
                "--report-goal {} is more than --devices {}: a round needs that many distinct devices; raise --devices to at least {} or lower --report-goal",
                self.report_goal, self.devices, self.report_goal
            ));
        }
        if self.secure_aggregation
            && (self.adaptive_clipping || self.evaluate_every.is_some() || self.health)
        {
            return refuse(
                "--secure-aggregation masks only the update: drop --adaptive-clipping, --evaluate-every and --health".to_string(),
            );
        }
        if self.distributed_noise && !(self.secure_aggregation && self.noise == DemoNoise::Gaussian)
        {
            return refuse(
                "--distributed-noise needs --secure-aggregation and the Gaussian mechanism (the key services draw per-round noise; DP-FTRL's is correlated across rounds)".to_string(),
            );
        }
        if let Some(k) = self.evaluate_every
            && !(1..=self.rounds).contains(&k)
        {
            return refuse(format!(
                "--evaluate-every {k} must be between 1 and --rounds {}",
                self.rounds
            ));
        }
        Ok(())
    }
}

pub async fn run(options: DemoOptions) -> Result<DemoSummary, DemoError> {
    options.check()?;
    let started = Instant::now();
    println!(
        "confed demo: DEV MODE. Dev attester (no TEE), all key services in this process: nothing here is confidential."
    );
    println!("confed demo: state in {}", options.data_dir.display());
    let system = start_system(options.data_dir.clone(), options.ports).await?;
    let token = system
        .tenant("demo-partner")
        .await
        .map_err(|e| setup("creating the demo tenant")(e.into()))?;
    let http = confed_protocol::http::client(Duration::from_secs(30));
    let url = system.url.clone();
    let mut privacy =
        json!({"epsilon": options.epsilon, "delta": options.delta, "clip_norm": options.clip_norm});
    let min_separation = (options.devices / options.report_goal.max(1) as usize)
        .clamp(1, options.rounds.max(1) as usize);
    match options.noise {
        DemoNoise::Gaussian => {}
        DemoNoise::Tree => {
            privacy["mechanism"] = json!("tree_aggregation");
            privacy["min_separation"] = json!(min_separation);
        }
        DemoNoise::Blt => {
            privacy["mechanism"] = json!("blt");
            privacy["min_separation"] = json!(min_separation);
        }
    }
    if options.adaptive_clipping {
        privacy["adaptive_clipping"] = json!({});
    }
    if options.health {
        privacy["health"] = json!({});
    }
    let mut trust = system.trust.clone();
    // Masked updates count only under device tokens whose nonce binds their seeds.
    let issuer = match options.device_auth || options.secure_aggregation {
        true => Some(dev_issuer(&options).await?),
        false => None,
    };
    let mut request = json!({
        "population": "demo", "rounds": options.rounds, "report_goal": options.report_goal,
        "privacy": privacy,
        "server_learning_rate": options.server_learning_rate,
        "server_optimizer": options.optimizer,
        "plan": {"epochs": 2, "batch_size": 16, "learning_rate": 0.2},
        // Each device sends at an instant it draws in this window after its assignment,
        // whatever its training did (docs/privacy.md, "Time"): short here, so the demo is quick;
        // training a round takes a few milliseconds.
        "upload_window": {"start_ms": DEMO_WINDOW_MS.0, "end_ms": DEMO_WINDOW_MS.1},
    });
    if let Some(every) = options.evaluate_every {
        // Cross-entropy of a 10-class model starts at ln 10 (2.3): a bound of 5 keeps the loss
        // sum's noise (in units of the bound) small.
        request["evaluation"] =
            json!({"every": every, "max_examples": HELD_OUT_ROWS, "max_loss": 5.0});
        if let Some(stddev) = options.evaluation_stddev {
            request["evaluation"]["stddev"] = json!(stddev);
        }
    }
    if let Some((issuer, _)) = &issuer {
        request["device_auth"] = json!({"issuer": issuer.name, "token_keys": issuer.token_keys});
        trust.token_issuers.push(issuer.clone());
        println!(
            "confed demo: the task requires device tokens (Privacy Pass) from an in-process DEV issuer at {}: {}",
            issuer.url,
            confed_issuer::routes::DEV_ATTESTER_WARNING
        );
    }
    if options.secure_aggregation {
        request["secure_aggregation"] = json!(true);
        println!(
            "confed demo: secure aggregation: each device clips its update on the grid and masks it with seeds sealed to the key services; the enclave adds masked updates only, and the key services remove the masks of the round's one agreed set"
        );
    }
    if options.distributed_noise {
        request["distributed_noise"] = json!(true);
        println!(
            "confed demo: distributed noise: every group of key services adds the round's full noise to its mask sums; the enclave never holds an un-noised sum, and the release carries sqrt(groups) times the noise"
        );
    }
    let task_id = create_task(&http, &url, &token, &request).await?;
    let uploaded = http
        .put(format!("{url}/v1/tasks/{task_id}/model"))
        .bearer_auth(&token)
        .header("content-type", "application/octet-stream")
        .body(simulate::initial_model(options.seed))
        .send()
        .await
        .map_err(api)?;
    if !uploaded.status().is_success() {
        return Err(api(uploaded.text().await.unwrap_or_default()));
    }
    println!(
        "confed demo: task {task_id}: {} rounds of {} devices from a population of {}, epsilon {} delta {} over all rounds, clip norm {}, {}, server optimizer {} (learning rate {})",
        options.rounds,
        options.report_goal,
        options.devices,
        options.epsilon,
        options.delta,
        options.clip_norm,
        match options.noise {
            DemoNoise::Tree => format!(
                "DP-FTRL tree aggregation (trees and minimum separation of {min_separation} rounds)"
            ),
            DemoNoise::Blt => format!(
                "DP-FTRL with BLT noise (minimum separation of {min_separation} rounds, buffers optimized by the server)"
            ),
            DemoNoise::Gaussian => "Gaussian mechanism".to_string(),
        } + if options.adaptive_clipping {
            " with adaptive clipping"
        } else {
            ""
        } + if options.health {
            ", the noised health signal"
        } else {
            ""
        },
        options.optimizer.name(),
        options.server_learning_rate
    );
    println!(
        "confed demo: each device sends {}-{} ms after its assignment, at an instant it draws before it trains, whatever its training did",
        DEMO_WINDOW_MS.0, DEMO_WINDOW_MS.1
    );
    if let Some(every) = options.evaluate_every {
        println!(
            "confed demo: every {every} rounds the devices also evaluate the model they train from on {HELD_OUT_ROWS} held-out examples each; the enclave releases the sums with noise charged to the budget"
        );
    }
    let held_out = Synthetic::standard(options.seed).test_set(2000);
    let model_accuracy = |bytes: &[u8]| {
        Softmax::from_safetensors(bytes)
            .map(|m| m.accuracy(&held_out))
            .map_err(|e| setup("reading a model version")(e.into()))
    };
    let mut accuracy = vec![model_accuracy(&simulate::initial_model(options.seed))?];
    println!(
        "round 0: accuracy {:.1}% (10 classes: chance is 10%)",
        accuracy[0] * 100.0
    );
    let bars = MultiProgress::new();
    if !options.progress {
        bars.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let rounds_bar = bars.add(
        ProgressBar::new(u64::from(options.rounds)).with_style(
            ProgressStyle::with_template("{prefix:>14} [{bar:40}] {pos}/{len} {msg}")
                .expect("static template")
                .progress_chars("=> "),
        ),
    );
    rounds_bar.set_prefix("rounds");
    rounds_bar.set_message(format!("privacy spent: epsilon 0 of {}", options.epsilon));
    // Lines go above the bars on a terminal, plainly otherwise.
    let say = |line: String| {
        if options.progress {
            bars.suspend(|| println!("{line}"));
        } else {
            println!("{line}");
        }
    };
    let mut epsilon_spent = 0.0;
    let mut clip_norms = Vec::new();
    let mut evaluations = Vec::new();
    let mut authenticated = Vec::new();
    let mut manifests = Vec::new();
    for round in 1..=options.rounds {
        // Each round draws the next `report_goal` devices of the population, round-robin.
        let first =
            (u64::from(round - 1) * u64::from(options.report_goal)) % options.devices as u64;
        let summary = simulate::run(SimulationConfig {
            server: url.clone(),
            population: "demo".into(),
            devices: options.report_goal as usize,
            first_device: first,
            // Every device of the round at once: each waits for its send instant.
            concurrency: options.report_goal as usize,
            rounds: 1,
            trust: trust.clone(),
            train: true,
            seed: options.seed,
            rows_per_device: 2 * HELD_OUT_ROWS,
            max_retry_wait: Duration::from_millis(100),
            idle_limit: 600,
            client_version: "1.0.0".into(),
            progress: options.progress,
            bars: Some(bars.clone()),
            // The population's devices keep what they served, as real devices do.
            state_dir: Some(options.data_dir.join("devices")),
            analytics: None,
        })
        .await?;
        if let Some(failure) = summary.failures.first() {
            return Err(DemoError::DeviceFailed(failure.clone()));
        }
        let model = wait_for_model(&http, &url, &token, &task_id, round).await?;
        accuracy.push(model_accuracy(&model)?);
        let releases = system
            .db
            .releases_of_task(&task_id)
            .await
            .map_err(|e| setup("reading the releases")(e.into()))?;
        let release = releases.last().ok_or_else(|| api("no release recorded"))?;
        epsilon_spent = release.epsilon_spent;
        // What a partner would run: the release checked against the devices' trust file.
        let verified =
            crate::verify::verify_release(&url, &token, &task_id, u64::from(round), &system.trust)
                .await
                .map_err(api)?;
        if !verified.ok() {
            return Err(api(format!(
                "round {round}'s release does not verify: {}",
                verified.failures.join("; ")
            )));
        }
        let manifest = confed_worker_api::Manifest::from_json(&release.manifest_json).ok();
        let clip = manifest.as_ref().map_or(options.clip_norm, |m| m.clip_norm);
        let authenticated_now = manifest.as_ref().and_then(|m| m.authenticated);
        authenticated.push(authenticated_now);
        clip_norms.push(clip);
        manifests.extend(manifest);
        if let Some(point) = crate::db::point_of(release.round_number, &release.manifest_json) {
            let shown = |v: Option<f64>, scale: f64, unit: &str| {
                v.map_or("none (no examples after noise)".into(), |v| {
                    format!("{:.1}{unit}", v * scale)
                })
            };
            say(format!(
                "round {round}: the devices evaluated model version {}: accuracy {} (the demo's own held-out set: {:.1}%), loss {}, over {:.0} examples (noise {:.0} examples per sum)",
                point.model_version,
                shown(point.accuracy, 100.0, "%"),
                accuracy[point.model_version as usize] * 100.0,
                shown(point.loss, 1.0, ""),
                point.examples,
                point.stddev
            ));
            evaluations.push(point);
        }
        if let Some(health) = manifests
            .last()
            .filter(|_| options.health)
            .and_then(|m| m.health.as_ref())
        {
            say(format!(
                "round {round}: health: {} of {} devices sent zeros, noised (±{:.0} at 95 %; the devices themselves know of {})",
                health.zeroed,
                release.included,
                2.0 * health.stddev,
                summary.zeroed.len()
            ));
        }
        if !summary.zeroed.is_empty() {
            // Only the devices know (the demo runs them): the server saw ordinary completions.
            say(format!(
                "round {round}: {} devices sent zeros (training late at their send instant, or failed); the server cannot tell",
                summary.zeroed.len()
            ));
        }
        let masked = manifests
            .last()
            .and_then(|m| m.masking.as_ref())
            .map_or(String::new(), |m| {
                format!(
                    ", masked ({}, {} of {} key services, {} answered)",
                    m.scheme,
                    m.threshold,
                    m.services,
                    m.answered.len()
                )
            });
        say(format!(
            "round {round}: {} contributions aggregated{}{masked} ({} excluded), clip norm {clip:.3}, privacy spent epsilon {:.2} of {}, accuracy {:.1}%, release verified",
            release.included,
            authenticated_now.map_or(String::new(), |n| format!(
                ", {n} with a verified device token"
            )),
            release.excluded,
            epsilon_spent,
            options.epsilon,
            accuracy[round as usize] * 100.0
        ));
        rounds_bar.inc(1);
        rounds_bar.set_message(format!(
            "privacy spent: epsilon {epsilon_spent:.2} of {}",
            options.epsilon
        ));
    }
    rounds_bar.finish_and_clear();
    if let Some((_, serving)) = issuer {
        serving.abort();
    }
    system.shutdown().await;
    let elapsed = started.elapsed();
    println!(
        "confed demo: done in {:.1} s; accuracy {:.1}% -> {:.1}% with differential privacy (epsilon {:.2}, delta {})",
        elapsed.as_secs_f64(),
        accuracy[0] * 100.0,
        accuracy.last().copied().unwrap_or_default() * 100.0,
        epsilon_spent,
        options.delta
    );
    Ok(DemoSummary {
        accuracy,
        clip_norms,
        evaluations,
        epsilon_spent,
        elapsed,
        authenticated,
        manifests,
    })
}

/// A DEV token issuer in this process (`confed-issuer` with the dev attester and a fresh key): L
/// is the task's rounds, so each device may serve every round.
async fn dev_issuer(
    options: &DemoOptions,
) -> Result<
    (
        confed_protocol::trust::TrustedIssuer,
        tokio::task::JoinHandle<()>,
    ),
    DemoError,
> {
    use base64::Engine as _;
    let signer =
        tokio::task::spawn_blocking(confed_protocol::privacy_pass::issuance::TokenSigner::generate)
            .await
            .map_err(|e| setup("generating the issuer key")(e.into()))?
            .map_err(|e| setup("generating the issuer key")(e.into()))?;
    let token_key = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(signer.spki());
    let limiter = confed_issuer::limiter::Limiter::open(
        &options.data_dir.join("issuer"),
        options.rounds.max(1),
        86_400,
    )
    .map_err(|e| setup("opening the issuer's state")(e.into()))?;
    let issuer = confed_issuer::Issuer::new(
        "demo-issuer".into(),
        signer,
        Box::new(confed_issuer::attester::dev::DevAttester),
        limiter,
        86_400,
        Arc::new(SystemClock),
    )
    .map_err(|e| setup("starting the issuer")(e.to_string().into()))?;
    let listener = crate::ports::bind_loopback(options.ports)
        .await
        .map_err(|e| setup("starting the issuer")(e.to_string().into()))?;
    let url = format!(
        "http://{}",
        listener
            .local_addr()
            .map_err(|e| setup("starting the issuer")(e.into()))?
    );
    let app = confed_issuer::routes::router(Arc::new(issuer));
    let serving = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((
        confed_protocol::trust::TrustedIssuer {
            name: "demo-issuer".into(),
            token_keys: vec![token_key],
            url,
        },
        serving,
    ))
}

/// The demos' system: three key services (any two reconstruct a task key), the APIs, the
/// scheduler and an enclave worker in this process, on SQLite and a blob directory in `data_dir`.
pub(super) async fn start_system(
    data_dir: PathBuf,
    ports: Option<crate::ports::PortRange>,
) -> Result<EmbeddedSystem, DemoError> {
    EmbeddedSystem::start(EmbeddedOptions {
        blobs: None,
        data_dir,
        keyservices: 3,
        threshold: 2,
        clock: Arc::new(SystemClock),
        background_worker: true,
        scheduler_period: Duration::from_secs(1),
        worker_token: None,
        attester_key: None,
        database: None,
        partitioning: Default::default(),
        ports,
    })
    .await
    .map_err(|e| setup("starting the embedded system")(e.into()))
}

/// Polls until model version `round` exists (the enclave worker released and applied the round).
async fn wait_for_model(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    task_id: &str,
    round: u32,
) -> Result<Vec<u8>, DemoError> {
    let deadline = Instant::now() + ROUND_TIMEOUT;
    loop {
        let reply = http
            .get(format!("{url}/v1/tasks/{task_id}/models/{round}"))
            .bearer_auth(token)
            .send()
            .await
            .map_err(api)?;
        if reply.status().is_success() {
            return Ok(reply.bytes().await.map_err(api)?.to_vec());
        }
        if Instant::now() > deadline {
            let task: Value = http
                .get(format!("{url}/v1/tasks/{task_id}/rounds"))
                .bearer_auth(token)
                .send()
                .await
                .map_err(api)?
                .json()
                .await
                .map_err(api)?;
            return Err(DemoError::Stalled {
                round,
                seconds: ROUND_TIMEOUT.as_secs(),
                state: task.to_string(),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
