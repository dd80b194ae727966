//! `confed demo --analytics`: new-word discovery end to end in one process (docs/analytics.md).
//! Simulated devices hold words of a Zipf vocabulary and a few planted new words; an analytics
//! task asks for the words held by many devices (an open-domain histogram with partition
//! selection); each device answers from its words, sealed at its drawn instant; the enclave
//! releases the words above the threshold with their noised counts; every release is verified;
//! and the discovered words are scored against the truth the demo knows.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::analytics_population::AnalyticsPopulation;
use super::demo::{DemoError, api, create_task};
use super::simulate::{self, SimulationConfig};

/// Bytes a word may have (longer ones are cut, as the device library does).
const MAX_KEY_BYTES: u32 = 24;
/// Keys one device contributes: more than any simulated device holds, so none is sampled out.
const KEYS_PER_DEVICE: u32 = 16;
const ROUND_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, Clone)]
pub struct AnalyticsDemoOptions {
    pub devices: usize,
    pub rounds: u32,
    pub epsilon: f64,
    pub delta: f64,
    pub seed: u64,
    pub data_dir: std::path::PathBuf,
    pub progress: bool,
    pub ports: Option<crate::ports::PortRange>,
}

/// What the demo measured, per round.
#[derive(Debug, Clone)]
pub struct DiscoveryRound {
    pub threshold: u64,
    /// Released words, with their noised counts.
    pub released: BTreeMap<String, i64>,
    /// Words whose true count of devices reaches the threshold.
    pub truth: BTreeSet<String>,
    pub precision: f64,
    pub recall: f64,
    pub epsilon_spent: f64,
}

/// The planted new words and the share of devices holding each.
fn planted() -> Vec<(String, f64)> {
    [
        ("skibidi", 0.08),
        ("rizzler", 0.04),
        ("glazing", 0.02),
        ("mewing", 0.01),
        ("delulu", 0.005),
        ("sigmacore", 0.002),
    ]
    .iter()
    .map(|(w, s)| (w.to_string(), *s))
    .collect()
}

pub async fn run(options: AnalyticsDemoOptions) -> Result<Vec<DiscoveryRound>, DemoError> {
    let started = Instant::now();
    println!(
        "confed demo --analytics: DEV MODE. Dev attester (no TEE), all key services in this process: nothing here is confidential."
    );
    let system = super::demo::start_system(options.data_dir.clone(), options.ports).await?;
    let token = system.tenant("demo-partner").await.map_err(api)?;
    let http = confed_protocol::http::client(Duration::from_secs(30));
    let url = system.url.clone();
    let request = json!({
        "kind": "analytics",
        "analytics": {"query": "open_histogram", "max_key_bytes": MAX_KEY_BYTES,
                      "keys_per_device": KEYS_PER_DEVICE},
        "population": "words", "rounds": options.rounds, "report_goal": options.devices,
        "privacy": {"epsilon": options.epsilon, "delta": options.delta},
        // Each device sends at an instant it draws in this window after its assignment, with its
        // answer if ready then (docs/privacy.md, "Time"): short here, so the demo is quick.
        "upload_window": {"start_ms": 500, "end_ms": 1500},
    });
    let task_id = create_task(&http, &url, &token, &request).await?;
    let population = AnalyticsPopulation::new(20_000, 1.0, 4, planted());
    println!(
        "confed demo --analytics: task {task_id}: which words do at least a threshold of devices hold? {} devices per round, {} round(s), epsilon {} delta {} over all rounds; each device holds 4 draws of a 20,000-word Zipf vocabulary and some of 6 planted new words, and sends up to {KEYS_PER_DEVICE} words of at most {MAX_KEY_BYTES} bytes",
        options.devices, options.rounds, options.epsilon, options.delta
    );
    let mut rounds = Vec::new();
    for round in 1..=options.rounds {
        let seed = options.seed ^ u64::from(round);
        let summary = simulate::run(SimulationConfig {
            server: url.clone(),
            population: "words".into(),
            devices: options.devices,
            first_device: 0,
            concurrency: 256,
            rounds: 1,
            trust: system.trust.clone(),
            train: false,
            seed,
            rows_per_device: 1,
            max_retry_wait: Duration::from_millis(100),
            idle_limit: 600,
            client_version: "1.0.0".into(),
            progress: options.progress,
            bars: None,
            state_dir: None,
            analytics: Some(population.clone()),
        })
        .await?;
        if let Some(failure) = summary.failures.first() {
            return Err(DemoError::DeviceFailed(failure.clone()));
        }
        if !summary.zeroed.is_empty() {
            // Only the devices know (the demo runs them): the server saw ordinary answers.
            println!(
                "round {round}: {} devices sent no words (their answer was not ready at their send instant); the server cannot tell",
                summary.zeroed.len()
            );
        }
        let (manifest, result) = wait_for_release(&http, &url, &token, &task_id, round).await?;
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
        let threshold = manifest["analytics"]["threshold"].as_u64().unwrap_or(0);
        let released: Vec<(String, i64)> =
            serde_json::from_value(result["keys"].clone()).map_err(api)?;
        let released: BTreeMap<String, i64> = released.into_iter().collect();
        let truth = truth_above(&population, options.devices, seed, threshold);
        let found = released.keys().filter(|k| truth.contains(*k)).count() as f64;
        let precision = match released.len() {
            0 => 1.0,
            n => found / n as f64,
        };
        let recall = match truth.len() {
            0 => 1.0,
            n => found / n as f64,
        };
        let epsilon_spent = manifest["privacy"]["epsilon_spent"].as_f64().unwrap_or(0.0);
        println!(
            "round {round}: threshold {threshold} devices (noise stddev {:.1}); released {} words, {} of the {} words at least {threshold} devices hold: precision {:.3}, recall {:.3}; release verified (signature and key-service receipts)",
            manifest["analytics"]["noise_stddev"]
                .as_f64()
                .unwrap_or(0.0),
            released.len(),
            found,
            truth.len(),
            precision,
            recall
        );
        for (word, share) in planted() {
            let held = (share * options.devices as f64).round();
            match released.get(&word) {
                Some(count) => println!(
                    "  planted {word:<10} (about {held:>4} devices): found, noised count {count}"
                ),
                None => println!("  planted {word:<10} (about {held:>4} devices): not released"),
            }
        }
        println!(
            "round {round}: privacy spent: epsilon {epsilon_spent:.3} of {} (delta {})",
            options.epsilon, options.delta
        );
        rounds.push(DiscoveryRound {
            threshold,
            released,
            truth,
            precision,
            recall,
            epsilon_spent,
        });
    }
    println!(
        "confed demo --analytics: done in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(rounds)
}

/// The words at least `threshold` devices hold (each device's words cut and counted once, as its
/// device library sends them).
fn truth_above(
    population: &AnalyticsPopulation,
    devices: usize,
    seed: u64,
    threshold: u64,
) -> BTreeSet<String> {
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    for device in 0..devices as u64 {
        let words: BTreeSet<String> = population
            .words(device, seed)
            .into_iter()
            .map(|w| confed_device::analytics::cut(&w, MAX_KEY_BYTES as usize).to_string())
            .collect();
        for word in words {
            *counts.entry(word).or_default() += 1;
        }
    }
    counts
        .into_iter()
        .filter(|(_, n)| *n >= threshold)
        .map(|(w, _)| w)
        .collect()
}

/// Polls until round `round`'s release exists; its manifest and result.
async fn wait_for_release(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    task_id: &str,
    round: u32,
) -> Result<(Value, Value), DemoError> {
    let deadline = Instant::now() + ROUND_TIMEOUT;
    let get = |path: String| http.get(format!("{url}{path}")).bearer_auth(token).send();
    loop {
        let manifest = get(format!("/v1/tasks/{task_id}/releases/{round}/manifest"))
            .await
            .map_err(api)?;
        if manifest.status().is_success() {
            let manifest: Value = manifest.json().await.map_err(api)?;
            let result: Value = get(format!("/v1/tasks/{task_id}/releases/{round}/average"))
                .await
                .map_err(api)?
                .json()
                .await
                .map_err(api)?;
            return Ok((manifest, result));
        }
        if Instant::now() > deadline {
            let rounds: Value = get(format!("/v1/tasks/{task_id}/rounds"))
                .await
                .map_err(api)?
                .json()
                .await
                .map_err(api)?;
            return Err(DemoError::Stalled {
                round,
                seconds: ROUND_TIMEOUT.as_secs(),
                state: rounds.to_string(),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
