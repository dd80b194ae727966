//! `confed devices`: simulated devices, also the load generator.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Subcommand;

#[derive(Subcommand)]
pub(crate) enum DevicesCommand {
    /// Run N devices that check in, train on private non-IID shards of a synthetic data set, seal
    /// their updates and upload them. Exits non-zero when device operations failed, when no
    /// device contributed, or when a round of the population still wants contributions after
    /// every device has stopped (the task did not finish), and says why.
    Simulate {
        /// Base URL of `confed serve`.
        #[arg(long)]
        server: String,
        /// The device population the devices check in to (a task's `population`).
        #[arg(long)]
        population: String,
        /// Simulated devices, each with its own data shard, state file and device key.
        #[arg(long, default_value_t = 100)]
        devices: usize,
        /// Devices running at once (the others wait their turn; a device runs until it has made
        /// its contributions or has gone --idle-limit answers without work).
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        /// Contributions per device before it stops (at most one a round: a device declines an
        /// assignment to a round it already contributed to).
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        /// Device trust configuration: {"threshold": T, "keyservices": [{"id", "verifying_key"}],
        /// "limits": {"max_epsilon", "max_delta", "min_reports"}}.
        #[arg(long)]
        trust: PathBuf,
        /// Send random updates of the model's shape instead of training (load generator).
        #[arg(long)]
        no_train: bool,
        /// Seed of the synthetic data set and of the devices' draws (the same seed, the same
        /// shards).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Training examples in each device's shard (and half as many held out for evaluation).
        #[arg(long, default_value_t = 200)]
        rows_per_device: usize,
        /// Longest wait when told to retry, in milliseconds (real devices wait the whole window).
        #[arg(long, default_value_t = 200)]
        max_retry_wait_ms: u64,
        /// Consecutive retry answers after which a device that has not yet contributed
        /// --rounds times stops (with --max-retry-wait-ms 200, 50 answers wait about 10 s: long
        /// enough to span the aggregation between two rounds).
        #[arg(long, default_value_t = 50)]
        idle_limit: usize,
        /// After the last device stops, how long a fresh device keeps checking in to see
        /// whether a round still wants contributions (the next round opens only after the
        /// previous one's aggregation): one that does makes the run fail, naming it. 0 skips
        /// the check (a load generator that fills rounds of a longer task, or a benchmark that
        /// times the run).
        #[arg(long, default_value_t = 3000)]
        settle_ms: u64,
        /// The client version the devices report at check-in (a task's `client_version` range
        /// must admit it).
        #[arg(long, default_value = "1.0.0")]
        client_version: String,
        /// Where each simulated device keeps the rounds it served and the evaluations it
        /// granted (device-<index>.json), so that devices run again remember them, as real
        /// devices must (DP-FTRL's min_separation and on-demand evaluation counts rest on it).
        #[arg(long, default_value = "confed-devices", conflicts_with = "forgetful")]
        state_dir: PathBuf,
        /// Keep that in memory only (a load generator's devices): restarted, they forget which
        /// rounds they served. Says so.
        #[arg(long)]
        forgetful: bool,
        /// A token issuer (its base URL) to trust besides the trust file's: the devices then
        /// take tasks requiring its tokens and obtain them with the dev attestation (only a dev
        /// issuer accepts it).
        #[arg(long)]
        issuer: Option<String>,
        /// Analytics tasks: the devices' words are drawn from a Zipf vocabulary of this many
        /// words (`w1`, `w2`, ...; closed domains read the rank as the key, quantiles a value
        /// growing with it).
        #[arg(long, default_value_t = 10_000)]
        vocabulary: u64,
        /// Analytics tasks: the Zipf exponent of the vocabulary.
        #[arg(long, default_value_t = 1.1)]
        zipf_exponent: f64,
        /// Analytics tasks: words each device draws from the vocabulary.
        #[arg(long, default_value_t = 4)]
        words_per_device: usize,
        /// Analytics tasks: new words planted in the population, each with the share of devices
        /// holding it, as WORD:SHARE,... (e.g. `skibidi:0.05,rizzler:0.01`).
        #[arg(long, value_name = "WORD:SHARE,...")]
        planted: Option<String>,
    },
    /// Write the synthetic task's initial model (zeros, safetensors) to upload as version 0.
    InitModel {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Fetch key services' verifying keys into a device trust configuration (check the keys with
    /// each operator out of band: this trusts whatever answers).
    TrustConfig {
        #[arg(long = "keyservice", required = true)]
        keyservices: Vec<String>,
        #[arg(long)]
        threshold: usize,
        /// n, the number of key services holding a share of each key (default: the key services
        /// given). Verifiers ask for a quorum of receipts computed from it and the threshold.
        #[arg(long)]
        shares: Option<usize>,
        /// Largest total epsilon of a task the device contributes to.
        #[arg(long)]
        max_epsilon: f64,
        /// Largest delta of a task the device contributes to.
        #[arg(long)]
        max_delta: f64,
        /// Fewest contributions (the policy's min_reports) a release may average.
        #[arg(long)]
        min_reports: u32,
        /// Pin the tenant (id) the device works for: other tenants' tasks are refused.
        #[arg(long)]
        tenant_id: Option<String>,
        /// A token issuer (base URL) whose directory's name and keys to list under
        /// token_issuers: the device then takes tasks requiring its tokens (check the keys with
        /// the issuer's operator out of band: this trusts whatever answers).
        #[arg(long = "issuer")]
        issuers: Vec<String>,
        /// Contribute only to masked tasks (`secure_aggregation`): a task served in the clear
        /// is refused.
        #[arg(long)]
        require_masking: bool,
        /// Contribute only to masked tasks whose key services draw the noise
        /// (`distributed_noise`): implies --require-masking.
        #[arg(long)]
        require_distributed_noise: bool,
    },
}

pub(super) async fn run(command: DevicesCommand) -> Result<()> {
    use confed::tools::simulate::{SimulationConfig, initial_model, run};
    match command {
        DevicesCommand::Simulate {
            server,
            population,
            devices,
            concurrency,
            rounds,
            trust,
            no_train,
            seed,
            rows_per_device,
            max_retry_wait_ms,
            idle_limit,
            settle_ms,
            client_version,
            state_dir,
            forgetful,
            issuer,
            vocabulary,
            zipf_exponent,
            words_per_device,
            planted,
        } => {
            let planted = match &planted {
                Some(text) => parse_planted(text)?,
                None => Vec::new(),
            };
            let population_of_words = confed::tools::analytics_population::AnalyticsPopulation::new(
                vocabulary,
                zipf_exponent,
                words_per_device,
                planted,
            );
            let mut trust = confed_device::load_trust(&trust)?;
            if let Some(url) = issuer {
                let issuer = confed::tools::issuer::trusted_issuer(&url)
                    .await
                    .map_err(anyhow::Error::msg)?;
                // The directory's keys join the trust file's (a rotation lists the next key
                // there before the issuer holds it): nothing the file trusts is dropped.
                match trust
                    .token_issuers
                    .iter_mut()
                    .find(|i| i.name == issuer.name)
                {
                    Some(listed) => {
                        for key in issuer.token_keys {
                            if !listed.token_keys.contains(&key) {
                                listed.token_keys.push(key);
                            }
                        }
                        listed.url = issuer.url;
                    }
                    None => trust.token_issuers.push(issuer),
                }
            }
            if forgetful {
                eprintln!(
                    "confed devices simulate: --forgetful: the devices keep the rounds they served in memory only; run again, they may serve rounds their tasks' privacy accounting forbids"
                );
            }
            let config = SimulationConfig {
                server,
                population: population.clone(),
                devices,
                first_device: 0,
                concurrency,
                rounds,
                trust,
                train: !no_train,
                seed,
                rows_per_device,
                max_retry_wait: Duration::from_millis(max_retry_wait_ms),
                idle_limit,
                client_version,
                progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
                bars: None,
                state_dir: (!forgetful).then_some(state_dir),
                analytics: Some(population_of_words),
            };
            let summary = run(config.clone()).await?;
            summary.print();
            // A run in which devices failed, or none contributed, is not a success for a
            // script or CI either.
            if let Some(first) = summary.failures.first() {
                anyhow::bail!(
                    "{} device operations failed; the first: {first}",
                    summary.failures.len()
                );
            }
            if summary.contributions == 0 {
                anyhow::bail!(
                    "no device contributed: is a task of population {population:?} open (model version 0 uploaded), and do the devices' trust limits accept its policy?"
                );
            }
            // Every device has stopped: a round that still wants contributions is a run that
            // did not finish its task, whatever each device did.
            use confed::tools::leftover;
            if settle_ms == 0 {
                return Ok(());
            }
            let open = leftover::open_work(
                &config,
                Duration::from_millis(settle_ms),
                Duration::from_millis(max_retry_wait_ms.clamp(50, 500)),
            )
            .await?;
            if let Some(why) = leftover::explain(&open, &summary, &config) {
                anyhow::bail!(why);
            }
        }
        DevicesCommand::InitModel { out, seed } => {
            std::fs::write(&out, initial_model(seed))
                .with_context(|| format!("writing {}", out.display()))?;
            let task = confed::tools::train::Synthetic::standard(seed);
            println!(
                "wrote {} (softmax regression, {} classes x {} features, zeros: dense.weight [{}, {}], dense.bias [{}])",
                out.display(),
                task.classes,
                task.features,
                task.classes,
                task.features,
                task.classes
            );
        }
        DevicesCommand::TrustConfig {
            keyservices,
            threshold,
            shares,
            max_epsilon,
            max_delta,
            min_reports,
            tenant_id,
            issuers,
            require_masking,
            require_distributed_noise,
        } => {
            let mut token_issuers = Vec::new();
            for url in &issuers {
                token_issuers.push(
                    confed::tools::issuer::trusted_issuer(url)
                        .await
                        .map_err(anyhow::Error::msg)?,
                );
            }
            let client = confed_protocol::http::client(Duration::from_secs(10));
            let mut entries = Vec::new();
            for url in &keyservices {
                let set: confed_attestation::exchange::KeySet = client
                    .get(format!("{}/v1/keys", url.trim_end_matches('/')))
                    .send()
                    .await
                    .and_then(|r| r.error_for_status())
                    .with_context(|| format!("fetching {url}/v1/keys"))?
                    .json()
                    .await
                    .with_context(|| format!("reading {url}/v1/keys"))?;
                entries.push(confed_protocol::trust::TrustedEntry {
                    id: set.keyservice_id,
                    verifying_key: set.verifying_key,
                });
            }
            let config = confed_protocol::trust::TrustConfig {
                threshold,
                shares: Some(shares.unwrap_or(entries.len())),
                keyservices: entries,
                limits: confed_protocol::policy::DeviceLimits {
                    max_epsilon,
                    max_delta,
                    min_reports,
                },
                tenant_id,
                token_issuers,
                require_masking: require_masking || require_distributed_noise,
                require_distributed_noise,
            };
            config.check()?;
            println!("{}", serde_json::to_string_pretty(&config)?);
        }
    }
    Ok(())
}

/// `--planted WORD:SHARE,...`: each word with the share of devices holding it, in [0, 1].
fn parse_planted(text: &str) -> Result<Vec<(String, f64)>> {
    text.split(',')
        .map(|pair| {
            let (word, share) = pair
                .rsplit_once(':')
                .ok_or_else(|| anyhow::anyhow!("--planted {pair:?}: give WORD:SHARE"))?;
            let share: f64 = share
                .parse()
                .ok()
                .filter(|s: &f64| (0.0..=1.0).contains(s))
                .ok_or_else(|| {
                    anyhow::anyhow!("--planted {pair:?}: SHARE is a number in [0, 1]")
                })?;
            if word.is_empty() {
                anyhow::bail!("--planted {pair:?}: the word is empty");
            }
            Ok((word.to_string(), share))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planted_words_parse_with_their_shares_and_a_bad_pair_says_what_is_wrong() {
        let planted = parse_planted("skibidi:0.05,a:b:1").unwrap();
        assert_eq!(planted, vec![("skibidi".into(), 0.05), ("a:b".into(), 1.0)]);
        for bad in ["skibidi", "skibidi:2", ":0.5", "w:x"] {
            assert!(parse_planted(bad).is_err(), "{bad}");
        }
    }
}
