//! The scale-out deployment as separate processes, started by `deploy/local/cluster.sh`: two API
//! replicas, a scheduler and two `confed-enclave` workers on one PostgreSQL database and one GCS
//! bucket (emulator), with five key services (3-of-5). Simulated devices are spread over both
//! APIs for three rounds; every round must complete exactly once, with every acknowledged
//! contribution included once. Then a task that requires device tokens: an outsider's
//! token-less upload straight to the bucket is refused at its report, and devices holding the
//! cluster issuer's tokens fill the round, every contribution authenticated. Last, one key
//! service is killed in the middle of a round, and the round still releases (q = 4 of 5).
//!
//! Runs when `CONFED_TEST_DATABASE_URL` and `CONFED_TEST_GCS_ENDPOINT` are set (`.ci/run` sets
//! both); otherwise says so once and passes.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::database::{fresh_postgres_database, postgres_url};
use common::direct_upload::outsider_upload;
use common::gcs::emulator;
use common::system::{create_task, create_task_with, rounds_at};
use confed::tools::simulate::{self, SimulationConfig};
use confed_protocol::trust::TrustConfig;

/// The rounds `create_task` plans.
const ROUNDS: i64 = 3;
const GOAL: usize = 20;
/// Devices per API replica per batch: together more than a round's goal (over-selection).
const DEVICES_PER_API: usize = 15;
const BOUND: Duration = Duration::from_secs(180);

/// Stops every process of the cluster when the test ends, also when it fails.
struct Cluster {
    dir: tempfile::TempDir,
    settings: BTreeMap<String, String>,
}

impl Cluster {
    fn script() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/local/cluster.sh")
    }

    fn start(database: &str, endpoint: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let output = std::process::Command::new(Self::script())
            .arg("start")
            .arg(dir.path().join("cluster"))
            .env("CONFED_BIN", env!("CARGO_BIN_EXE_confed"))
            .env("CONFED_ENCLAVE_BIN", common::enclave_binary())
            .env("CONFED_DATABASE_URL", database)
            .env("CONFED_GCS_ENDPOINT", endpoint)
            .env("CONFED_LOCAL_BASE_PORT", free_port_block(16).to_string())
            .output()
            .unwrap();
        let cluster = Self {
            settings: String::from_utf8_lossy(&output.stdout)
                .lines()
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            dir,
        };
        assert!(
            output.status.success(),
            "cluster.sh start failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        cluster
    }

    fn get(&self, name: &str) -> &str {
        self.settings
            .get(name)
            .unwrap_or_else(|| panic!("cluster.sh printed no {name}"))
    }

    /// Kills one process of the cluster (SIGKILL: no goodbye) and waits until it is gone.
    fn kill(&self, name: &str) {
        let pid_file = self.dir.path().join(format!("cluster/pids/{name}.pid"));
        let pid = std::fs::read_to_string(&pid_file).unwrap();
        let killed = std::process::Command::new("kill")
            .args(["-KILL", pid.trim()])
            .status()
            .unwrap();
        assert!(killed.success(), "kill {name} ({pid})");
        std::fs::remove_file(pid_file).unwrap();
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("cluster/logs/{name}.log")))
            .unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::process::Command::new(Self::script())
            .arg("stop")
            .arg(self.dir.path().join("cluster"))
            .status();
    }
}

/// The first of `count` consecutive free loopback ports (the script uses fixed offsets), below
/// Linux's ephemeral range (32768-60999) so other tests' port-0 listeners cannot take them.
fn free_port_block(count: u16) -> u16 {
    let seed = std::process::id() as u16;
    for attempt in 0..200u16 {
        let base = 20_000 + (seed.wrapping_add(attempt.wrapping_mul(97)) % 12_000);
        let free = (0..count).all(|i| std::net::TcpListener::bind(("127.0.0.1", base + i)).is_ok());
        if free {
            return base;
        }
    }
    panic!("no block of {count} free ports");
}

fn devices(api: &str, first_device: u64, trust: &TrustConfig, seed: u64) -> SimulationConfig {
    devices_of("cluster", api, first_device, trust, seed)
}

fn devices_of(
    population: &str,
    api: &str,
    first_device: u64,
    trust: &TrustConfig,
    seed: u64,
) -> SimulationConfig {
    SimulationConfig {
        server: api.to_string(),
        population: population.into(),
        devices: DEVICES_PER_API,
        first_device,
        concurrency: 8,
        rounds: 1,
        trust: trust.clone(),
        train: false,
        seed,
        rows_per_device: 40,
        max_retry_wait: Duration::from_millis(50),
        idle_limit: 10,
        client_version: "1.0.0".into(),
        progress: false,
        bars: None,
        state_dir: None,
        analytics: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_over_two_api_replicas_complete_every_round_once_with_every_contribution() {
    let (Some(server), Some(endpoint)) = (postgres_url(), emulator()) else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "NOTE: CONFED_TEST_DATABASE_URL and CONFED_TEST_GCS_ENDPOINT are not both set: the \
             multi-process deployment test did not run"
        );
        return;
    };
    let database = fresh_postgres_database(&server).await;
    let cluster = Cluster::start(&database, &endpoint);
    let apis: Vec<String> = cluster
        .get("CONFED_API_URLS")
        .split(',')
        .map(str::to_string)
        .collect();
    assert_eq!(apis.len(), 2);
    let token = std::fs::read_to_string(cluster.get("CONFED_TENANT_TOKEN_FILE"))
        .unwrap()
        .trim()
        .to_string();
    let trust = confed_device::load_trust(Path::new(cluster.get("CONFED_TRUST_FILE"))).unwrap();
    confed_protocol::http::install_crypto_provider(); // the helpers use plain reqwest clients
    let task = create_task(&apis[0], &token, "cluster", 50.0, GOAL).await;

    let mut acknowledged = [0usize; 2];
    for round in 1..=ROUNDS {
        // One batch of devices per round, half on each replica, all at once.
        let first = (round as u64 - 1) * 2 * DEVICES_PER_API as u64;
        let (a, b) = tokio::join!(
            simulate::run(devices(&apis[0], first, &trust, round as u64)),
            simulate::run(devices(
                &apis[1],
                first + DEVICES_PER_API as u64,
                &trust,
                round as u64 + 100
            )),
        );
        acknowledged[0] += a.unwrap().contributions;
        acknowledged[1] += b.unwrap().contributions;

        // The scheduler, a worker and the key services finish the round on their own.
        let finished = tokio::time::timeout(BOUND, async {
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            loop {
                tick.tick().await;
                let states = rounds_at(&apis[1], &token, &task).await;
                let done = states
                    .iter()
                    .any(|r| r["round"] == round && r["state"] == "COMPLETED");
                if done {
                    return states;
                }
            }
        })
        .await;
        assert!(
            finished.is_ok(),
            "round {round} did not complete within {BOUND:?}\nworker1: {}\nworker2: {}\napi1: {}",
            cluster.log("worker1"),
            cluster.log("worker2"),
            cluster.log("api1")
        );
    }

    assert!(
        acknowledged.iter().all(|&n| n > 0),
        "both replicas served contributions: {acknowledged:?}"
    );
    let db = confed::db::Db::open_postgres(&database).await.unwrap();
    let releases = db.releases_of_task(&task).await.unwrap();
    let numbers: Vec<i64> = releases.iter().map(|r| r.round_number).collect();
    assert_eq!(numbers, vec![1, 2, 3], "one release per round");
    let states = rounds_at(&apis[0], &token, &task).await;
    assert_eq!(
        states.len(),
        ROUNDS as usize,
        "no retried attempts: {states:?}"
    );
    for state in &states {
        assert_eq!(state["state"], "COMPLETED", "{state}");
        assert_eq!(state["attempt"], 1, "{state}");
    }
    // Exactly once in the persisted state machine too: one transition into each state per round.
    sqlx::any::install_default_drivers();
    let sql = sqlx::AnyPool::connect(&database).await.unwrap();
    for state in ["AGGREGATING", "APPLYING", "COMPLETED"] {
        let transitions: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM state_history WHERE entity = 'round' AND to_state = $1 \
             AND entity_id IN (SELECT id FROM rounds WHERE task_id = $2)",
        )
        .bind(state)
        .bind(&task)
        .fetch_one(&sql)
        .await
        .unwrap();
        assert_eq!(transitions, ROUNDS, "rounds entering {state}");
    }
    let mut included = 0;
    for release in &releases {
        assert_eq!(release.excluded, 0, "round {}", release.round_number);
        let completed = db
            .completed_contributions(&task, release.round_number)
            .await
            .unwrap();
        assert_eq!(
            completed.len() as i64,
            release.included,
            "round {}: every completed contribution is in the release, once",
            release.round_number
        );
        included += release.included;
    }
    assert_eq!(
        included as usize,
        acknowledged.iter().sum::<usize>(),
        "every acknowledged contribution was included once"
    );
    assert_eq!(included as usize, GOAL * ROUNDS as usize);

    tokens_on_the_bucket_path(&cluster, &apis, &token, &trust, &db).await;

    // The shipped alert rules and dashboard, against what these processes export.
    crate::monitoring::check_shipped_monitoring(cluster.get("CONFED_METRICS_TARGETS")).await;

    a_key_service_lost_mid_round_stops_no_release(&cluster, &apis, &token, &trust, &db).await;
}

/// The first release of `task` once the cluster committed it (`Err` after `BOUND`).
async fn first_release(
    db: &confed::db::Db,
    task: &str,
) -> Result<confed::db::jobs::ReleaseRecord, tokio::time::error::Elapsed> {
    tokio::time::timeout(BOUND, async {
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        loop {
            tick.tick().await;
            if let Some(release) = db.releases_of_task(task).await.unwrap().pop() {
                return release;
            }
        }
    })
    .await
}

/// The shipped layout survives one lost key service (issue 47: with 2-of-3, killing one stopped
/// every round). Half a round's devices report, one key service is killed, the other half
/// report, and the round releases with receipts from the four that are left (q = 4).
async fn a_key_service_lost_mid_round_stops_no_release(
    cluster: &Cluster,
    apis: &[String],
    token: &str,
    trust: &TrustConfig,
    db: &confed::db::Db,
) {
    let population = "cluster-ks-lost";
    let task = create_task_with(
        &apis[0],
        token,
        population,
        50.0,
        GOAL,
        serde_json::json!({"rounds": 1}),
    )
    .await;
    let half = |api: &str, first_device: u64, seed: u64| SimulationConfig {
        devices: GOAL / 2,
        ..devices_of(population, api, first_device, trust, seed)
    };
    let before = simulate::run(half(&apis[0], 2_000, 11)).await.unwrap();
    assert_eq!(before.contributions, GOAL / 2, "{before:?}");
    assert!(db.releases_of_task(&task).await.unwrap().is_empty());
    cluster.kill("ks5");
    let after = simulate::run(half(&apis[1], 3_000, 12)).await.unwrap();
    assert!(after.contributions >= GOAL / 2, "{after:?}");
    let release = first_release(db, &task).await.unwrap_or_else(|_| {
        panic!(
            "the round did not release with one key service lost
worker1: {}
worker2: {}",
            cluster.log("worker1"),
            cluster.log("worker2")
        )
    });
    assert_eq!(release.included, GOAL as i64);
    let proof: serde_json::Value =
        serde_json::from_str(release.proof_json.as_deref().unwrap()).unwrap();
    let receipts: Vec<&str> = proof["receipts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["keyservice_id"].as_str().unwrap())
        .collect();
    assert!(receipts.len() >= 4, "q = 4 receipts: {receipts:?}");
    assert!(!receipts.contains(&"ks5"), "{receipts:?}");
}

/// Device tokens where devices upload straight to the bucket (issue 46): the report counts an
/// upload only once its token verifies, so an outsider cannot fill (and fail) a round, and devices
/// with the cluster issuer's tokens complete it.
async fn tokens_on_the_bucket_path(
    cluster: &Cluster,
    apis: &[String],
    token: &str,
    trust: &TrustConfig,
    db: &confed::db::Db,
) {
    let issuer = confed::tools::issuer::trusted_issuer(cluster.get("CONFED_ISSUER_URL"))
        .await
        .unwrap();
    const AUTHED_GOAL: usize = 10;
    let task = create_task_with(
        &apis[0],
        token,
        "cluster-tokens",
        50.0,
        AUTHED_GOAL,
        serde_json::json!({
            "rounds": 1,
            "device_auth": {"issuer": issuer.name, "token_keys": issuer.token_keys},
        }),
    )
    .await;
    let context = db.round_context(&task, 1).await.unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    for (case, forged) in [
        ("no token", None),
        (
            "a forged token",
            Some(vec![2u8; confed_protocol::privacy_pass::TOKEN_BYTES]),
        ),
    ] {
        let (status, detail) =
            outsider_upload(&apis[1], "cluster-tokens", trust, &context, now, forged).await;
        assert_eq!(status, 403, "{case}: {detail}");
    }
    assert!(
        db.completed_contributions(&task, 1)
            .await
            .unwrap()
            .is_empty()
    );
    let mut trusting = trust.clone();
    trusting.token_issuers.push(issuer);
    let outcome = simulate::run(devices_of("cluster-tokens", &apis[0], 1_000, &trusting, 7))
        .await
        .unwrap();
    assert!(outcome.contributions >= AUTHED_GOAL, "{outcome:?}");
    let completed = first_release(db, &task).await.unwrap_or_else(|_| {
        panic!(
            "the token task's round did not complete\n{}",
            cluster.log("worker1")
        )
    });
    let manifest: serde_json::Value = serde_json::from_str(&completed.manifest_json).unwrap();
    assert_eq!(completed.included, AUTHED_GOAL as i64, "{manifest}");
    assert_eq!(manifest["authenticated"], AUTHED_GOAL as i64, "{manifest}");
}
