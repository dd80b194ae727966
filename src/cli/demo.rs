//! `confed demo`: the whole system in one process, a task trained over several rounds.

use std::path::PathBuf;

use anyhow::Result;

#[derive(clap::Args)]
pub(crate) struct DemoArgs {
    /// New-word discovery instead of training: an analytics task over devices holding Zipf
    /// words and planted new words; prints the discovered words' precision and recall against
    /// the truth above the threshold (docs/analytics.md). Takes --devices (default 10,000, all
    /// in every round), --rounds (default 1), --epsilon, --delta, --seed.
    #[arg(long)]
    pub analytics: bool,
    /// Simulated devices in the population (default 300; 10,000 with --analytics).
    #[arg(long)]
    pub devices: Option<usize>,
    /// Rounds (default 5; 1 with --analytics).
    #[arg(long)]
    pub rounds: Option<u32>,
    /// Devices aggregated per round.
    #[arg(long, default_value_t = 100)]
    pub report_goal: u32,
    /// Total privacy budget over all rounds.
    #[arg(long, default_value_t = 4.0)]
    pub epsilon: f64,
    #[arg(long, default_value_t = 1e-6)]
    pub delta: f64,
    #[arg(long, default_value_t = 1.0)]
    pub clip_norm: f64,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// The server optimizer (with its default hyperparameters: docs/api.md).
    #[arg(long, value_enum, default_value = "fedavg")]
    pub optimizer: Optimizer,
    /// The server learning rate the optimizer steps with.
    #[arg(long, default_value_t = 1.0)]
    pub server_learning_rate: f64,
    /// The DP mechanism: `gaussian` (independent noise every round), `ftrl` (DP-FTRL with tree
    /// aggregation; also `tree`) or `blt` (DP-FTRL with BLT noise); under both DP-FTRL choices
    /// the minimum separation is how often the demo's round-robin brings a device back, devices /
    /// report_goal rounds.
    #[arg(long, value_enum, default_value = "gaussian")]
    pub mechanism: DemoMechanism,
    /// Adaptive clipping (target quantile 0.5, learning rate 0.2, count noise report_goal / 20),
    /// starting from --clip-norm.
    #[arg(long)]
    pub adaptive_clipping: bool,
    /// Federated evaluation every K rounds: the devices measure the model they train from on
    /// held-out examples and the enclave releases noised accuracy and loss (charged to epsilon).
    #[arg(long, value_name = "K")]
    pub evaluate_every: Option<u32>,
    /// With --evaluate-every: the noise on each evaluation sum, in examples (default
    /// report_goal x 20 / 20, the API's default for 20 held-out examples per device).
    #[arg(long, value_name = "EXAMPLES", requires = "evaluate_every")]
    pub evaluation_stddev: Option<f64>,
    /// The task requires Privacy Pass device tokens, from a DEV issuer started in process (dev
    /// attester: it shows the flow, it bounds nothing); releases state how many contributions
    /// carried a verified token.
    #[arg(long)]
    pub device_auth: bool,
    /// The noised health signal: every release says about how many devices sent zeros (at the
    /// API's default noise, charged to epsilon).
    #[arg(long)]
    pub health: bool,
    /// Secure aggregation beneath the enclave: devices clip and mask their updates with seeds
    /// only the key services hold; the enclave sees the round's sum alone, and every release
    /// says it was masked (implies --device-auth; not with --adaptive-clipping, --evaluate-every
    /// or --health).
    #[arg(long)]
    pub secure_aggregation: bool,
    /// With --secure-aggregation: the key services add the round's noise, so the enclave never
    /// holds an un-noised sum; every group of key services adds the full noise, so releases are
    /// noisier (sqrt(3) times here, 2-of-3). The Gaussian mechanism only.
    #[arg(long)]
    pub distributed_noise: bool,
    /// The loopback ports the demo listens on (its API, 3 key services and, with
    /// --device-auth, the token issuer), as START-END: the first free ones, in order (default:
    /// any free ports).
    #[arg(long, env = "CONFED_EMBEDDED_PORTS")]
    pub embedded_ports: Option<confed::ports::PortRange>,
    /// Where the demo keeps its state (default: a new directory under the system's temp dir,
    /// removed at the end).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
}

/// `--mechanism`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum DemoMechanism {
    Gaussian,
    #[value(alias = "tree")]
    Ftrl,
    Blt,
}

/// `--optimizer`: each with its default hyperparameters.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Optimizer {
    Fedavg,
    Fedavgm,
    Fedadam,
    Fedyogi,
}

impl From<Optimizer> for confed_worker_api::optimizer::ServerOptimizer {
    fn from(optimizer: Optimizer) -> Self {
        let name = match optimizer {
            Optimizer::Fedavg => "fedavg",
            Optimizer::Fedavgm => "fedavgm",
            Optimizer::Fedadam => "fedadam",
            Optimizer::Fedyogi => "fedyogi",
        };
        serde_json::from_value(serde_json::json!({ "name": name }))
            .expect("every optimizer has defaults for all its hyperparameters")
    }
}

pub(super) async fn run(args: DemoArgs) -> Result<()> {
    let (data_dir, temporary) = match args.data_dir {
        Some(dir) => (dir, false),
        None => {
            let unique = format!(
                "confed-demo-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis())
                    .unwrap_or_default()
            );
            (std::env::temp_dir().join(unique), true)
        }
    };
    if args.analytics {
        let outcome = confed::tools::analytics_demo::run(
            confed::tools::analytics_demo::AnalyticsDemoOptions {
                devices: args.devices.unwrap_or(10_000),
                rounds: args.rounds.unwrap_or(1),
                epsilon: args.epsilon,
                delta: args.delta,
                seed: args.seed,
                data_dir: data_dir.clone(),
                progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
                ports: args.embedded_ports,
            },
        )
        .await;
        if temporary {
            let _ = std::fs::remove_dir_all(&data_dir);
        }
        outcome?;
        return Ok(());
    }
    let outcome = confed::tools::demo::run(confed::tools::demo::DemoOptions {
        devices: args.devices.unwrap_or(300),
        rounds: args.rounds.unwrap_or(5),
        report_goal: args.report_goal,
        epsilon: args.epsilon,
        delta: args.delta,
        clip_norm: args.clip_norm,
        seed: args.seed,
        optimizer: args.optimizer.into(),
        server_learning_rate: args.server_learning_rate,
        noise: match args.mechanism {
            DemoMechanism::Gaussian => confed::tools::demo::DemoNoise::Gaussian,
            DemoMechanism::Ftrl => confed::tools::demo::DemoNoise::Tree,
            DemoMechanism::Blt => confed::tools::demo::DemoNoise::Blt,
        },
        adaptive_clipping: args.adaptive_clipping,
        evaluate_every: args.evaluate_every,
        evaluation_stddev: args.evaluation_stddev,
        data_dir: data_dir.clone(),
        progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        device_auth: args.device_auth,
        health: args.health,
        secure_aggregation: args.secure_aggregation,
        distributed_noise: args.distributed_noise,
        ports: args.embedded_ports,
    })
    .await;
    if temporary {
        let _ = std::fs::remove_dir_all(&data_dir);
    }
    outcome?;
    Ok(())
}
