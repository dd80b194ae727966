//! The overflow probe of issue 27, end to end through `confed serve` and its enclave worker: a
//! tenant uploads a model whose weights are finite but make training overflow exactly when a
//! training row's feature 0 exceeds a threshold theta (`weight[0, 0] = 1e37`, `bias[0] =
//! f32::MAX - 1e37 * theta`). Run once with theta below every device's feature and once above,
//! everything the tenant and the operator can see (the manifest apart from noised values and
//! per-run ids, the releases API, the rounds, the task, the assignments' states and every
//! recorded reason) must be the same: the devices send zero updates and report `completed`, and
//! the enclave has nothing to exclude. And a raw client that seals NaNs itself is included as
//! a zero update: the manifest has no `non_finite`.
//!
//! Not run again on PostgreSQL and GCS (.ci/run): `confed serve` with its own data directory
//! (SQLite); the engines' paths run in the modules that use the test database.

use crate::common;

use std::collections::BTreeMap;

use confed::tools::simulate::{self, Summary};
use confed::tools::train::{Softmax, Synthetic};
use serde_json::{Value, json};

use common::process::Server;

const DEVICES: usize = 6;
pub(crate) const ROWS: usize = 30;
/// The simulator's seed, as `common::process::simulated_devices` sets it.
const SEED: u64 = 7;

/// The largest value of feature 0 in each of the first `devices` simulated devices' shards.
pub(crate) fn feature_0_maxima(devices: usize) -> Vec<f32> {
    let task = Synthetic::standard(SEED);
    (0..devices as u64)
        .map(|i| {
            let shard = task.shard(i, ROWS);
            shard
                .x
                .chunks(shard.features)
                .map(|row| row[0])
                .fold(f32::NEG_INFINITY, f32::max)
        })
        .collect()
}

/// The probe model: training overflows (class 0's logit passes f32::MAX) exactly on a row whose
/// feature 0 exceeds `theta`.
pub(crate) fn probe_model(theta: f32) -> Vec<u8> {
    let task = Synthetic::standard(SEED);
    let mut model = Softmax::zeros(task.classes, task.features);
    model.weight[0] = 1e37;
    model.bias[0] = f32::MAX - 1e37 * theta;
    assert!(
        model.bias[0].is_finite(),
        "the model must be one the server accepts"
    );
    model.to_safetensors()
}

async fn simulate(server: &Server, population: &str) -> Summary {
    let config = common::process::simulated_devices(
        &server.url,
        population,
        &server.trust_file(),
        DEVICES,
        0,
        ROWS,
    );
    simulate::run(config).await.unwrap()
}

/// Everything of one probe run that the tenant or the operator can read, with what differs
/// between any two runs whatever the data (ids, hashes of per-run bytes, times) left out.
#[derive(Debug, PartialEq)]
struct Seen {
    manifest: Value,
    releases: Vec<Value>,
    rounds: Vec<Value>,
    task: Value,
    assignment_states: BTreeMap<String, i64>,
    assignment_reasons: BTreeMap<String, i64>,
}

fn without(mut value: Value, fields: &[&str]) -> Value {
    for field in fields {
        value.as_object_mut().unwrap().remove(*field);
    }
    value
}

async fn seen(server: &Server, task: &str) -> Seen {
    let manifest: Value = serde_json::from_slice(
        &server
            .get_bytes(&format!("/v1/tasks/{task}/releases/1/manifest"))
            .await,
    )
    .unwrap();
    // Per-run values: the task's id and policy, the model's hash (theta), the refs' digests
    // (assignment ids are random) and the noised average's hash.
    let manifest = without(
        manifest,
        &[
            "task_id",
            "policy_sha256",
            "model_sha256",
            "included_digest",
            "inputs_digest",
            "average_sha256",
        ],
    );
    let releases = server.get(&format!("/v1/tasks/{task}/releases")).await["releases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| json!({"round": r["round"], "included": r["included"], "excluded": r["excluded"], "epsilon_spent": r["epsilon_spent"]}))
        .collect();
    let rounds = server.get(&format!("/v1/tasks/{task}/rounds")).await["rounds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| without(r.clone(), &["deadline", "opened_at", "closed_at"]))
        .collect();
    let task_view = without(
        server.get(&format!("/v1/tasks/{task}")).await,
        &[
            "id",
            "population",
            "policy",
            "policy_sha256",
            "created_at",
            "updated_at",
            "recent_eligible_checkins",
            "recent_eligible_devices",
        ],
    );
    let db = rusqlite::Connection::open(server.data.join("confed.db")).unwrap();
    let grouped = |sql: &str| -> BTreeMap<String, i64> {
        let mut statement = db.prepare(sql).unwrap();
        statement
            .query_map([task], |row| Ok((row.get(0)?, row.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    };
    let assignment_states = grouped(
        "SELECT a.state, COUNT(*) FROM assignments a JOIN rounds r ON a.round_id = r.id
         WHERE r.task_id = ?1 GROUP BY a.state",
    );
    let assignment_reasons = grouped(
        "SELECT COALESCE(h.from_state, '') || ' -> ' || h.to_state || ': ' || h.reason, COUNT(*)
         FROM state_history h JOIN assignments a ON h.entity_id = a.id
         JOIN rounds r ON a.round_id = r.id WHERE r.task_id = ?1 GROUP BY 1",
    );
    Seen {
        manifest,
        releases,
        rounds,
        task: task_view,
        assignment_states,
        assignment_reasons,
    }
}

async fn probe(server: &Server, population: &str, theta: f32) -> (Seen, Summary) {
    let task = server
        .open_task(
            json!({
                "population": population, "rounds": 1, "report_goal": DEVICES,
                "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0},
                "plan": {"epochs": 1, "batch_size": 10, "learning_rate": 0.1},
            }),
            probe_model(theta),
        )
        .await;
    let summary = simulate(server, population).await;
    server.wait_for_model(&task, 1).await;
    (seen(server, &task).await, summary)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overflow_probe_reads_the_same_whichever_side_of_theta_the_data_lies() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data")).await;
    let maxima = feature_0_maxima(DEVICES);
    let lowest = maxima.iter().copied().fold(f32::INFINITY, f32::min);
    let highest = maxima.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    assert!(
        lowest > 0.0,
        "every shard has a positive feature 0: {maxima:?}"
    );
    let (below, below_devices) = probe(&server, "probe-below", lowest / 2.0).await;
    let (above, above_devices) = probe(&server, "probe-above", highest + 1.0).await;

    // The probe did what it is meant to: every device's training overflowed below theta, and
    // none above it; the devices alone know.
    assert_eq!(
        below_devices.zeroed.len(),
        DEVICES,
        "{:?}",
        below_devices.zeroed
    );
    assert!(
        below_devices
            .zeroed
            .iter()
            .all(|p| p.contains("not finite")),
        "{:?}",
        below_devices.zeroed
    );
    assert!(
        above_devices.zeroed.is_empty(),
        "{:?}",
        above_devices.zeroed
    );
    for summary in [&below_devices, &above_devices] {
        assert_eq!(summary.contributions, DEVICES);
        assert!(summary.failures.is_empty(), "{:?}", summary.failures);
    }
    // What the tenant and the operator see is the same.
    assert_eq!(below.manifest["included"], DEVICES);
    assert_eq!(below.manifest["excluded"], json!({}));
    assert_eq!(below, above);
    assert_eq!(
        below.assignment_states,
        BTreeMap::from([("COMPLETED".to_string(), DEVICES as i64)])
    );
    server.stop().await;
}

/// A client that skips the device library and seals an update of NaNs and infinities itself:
/// the enclave includes it as a zero update and the manifest names no reason for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_clients_non_finite_update_is_included_as_zero() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data")).await;
    let task = server
        .open_task(
            json!({
                "population": "raw", "rounds": 1, "report_goal": 2,
                "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0},
            }),
            probe_model(1.0),
        )
        .await;
    let trust = confed_device::load_trust(&server.trust_file()).unwrap();
    let client = confed_device::DeviceClient::new(&server.url, &trust).unwrap();
    for value in [f32::NAN, f32::INFINITY] {
        let confed_device::Checkin::Assigned(assignment) = client
            .checkin("raw", "1.0.0", &Default::default())
            .await
            .unwrap()
        else {
            panic!("an assignment");
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let key = client.verified_key(&assignment, now).unwrap();
        let policy = client.accepted_policy(&assignment, "raw").unwrap();
        let model = client.model(&assignment).await.unwrap();
        let mut poisoned = Softmax::from_safetensors(&model.bytes).unwrap();
        poisoned.weight.iter_mut().for_each(|w| *w = value);
        let context = confed_protocol::envelope::RoundContext {
            task_id: assignment.task_id.clone(),
            round: 1,
            policy_sha256: policy.sha256.clone(),
            model_sha256: model.sha256.clone(),
        };
        let sealed = confed_protocol::envelope::seal_with(
            &confed_protocol::hpke::RustCrypto,
            &key,
            &assignment.encryption.key_id,
            &context,
            &assignment.assignment_id,
            &poisoned.to_safetensors(),
        )
        .unwrap()
        .to_cbor();
        client.upload(&assignment, sealed).await.unwrap();
        client
            .report(&assignment, confed_device::ReportOutcome::Completed, None)
            .await
            .unwrap();
    }
    let next = server.wait_for_model(&task, 1).await;
    let manifest: Value = serde_json::from_slice(
        &server
            .get_bytes(&format!("/v1/tasks/{task}/releases/1/manifest"))
            .await,
    )
    .unwrap();
    assert_eq!(manifest["included"], 2);
    assert_eq!(manifest["excluded"], json!({}));
    let next = Softmax::from_safetensors(&next).unwrap();
    assert!(next.weight.iter().chain(&next.bias).all(|v| v.is_finite()));
    server.stop().await;
}

/// The amplifier of issue 45: the probe model with subnormal weights for the other classes and a
/// plan of 100 epochs of batch 1 at learning rate 0, so that training is slow on subnormals
/// until a row crosses theta. The simulated devices flush subnormals (defence in depth), but the
/// property does not rest on that: every contribution is sent at the instant its device drew
/// before training, and what the operator records of each assignment (created to completed) is
/// one of those instants, on both sides of theta.
fn amplifier_model(theta: f32) -> Vec<u8> {
    let mut model = Softmax::from_safetensors(&probe_model(theta)).unwrap();
    for w in model.weight.iter_mut().skip(model.features) {
        *w = 1e-40;
    }
    model.to_safetensors()
}

/// The upload window of the amplifier tasks, in ms after the assignment.
const AMPLIFIER_WINDOW: (i64, i64) = (300, 900);
/// How far past its drawn instant a send may start, or a report be recorded, on a loaded 2-core
/// CI machine: scheduling and the loopback round trip, not training.
const JITTER_MS: i64 = 300;

async fn amplifier(server: &Server, population: &str, theta: f32) -> (Summary, Vec<i64>) {
    let task = server
        .open_task(
            json!({
                "population": population, "rounds": 1, "report_goal": DEVICES,
                "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0},
                "plan": {"epochs": 100, "batch_size": 1, "learning_rate": 0.0},
                "upload_window": {"start_ms": AMPLIFIER_WINDOW.0, "end_ms": AMPLIFIER_WINDOW.1},
            }),
            amplifier_model(theta),
        )
        .await;
    let summary = simulate(server, population).await;
    server.wait_for_model(&task, 1).await;
    let db = rusqlite::Connection::open(server.data.join("confed.db")).unwrap();
    let mut statement = db
        .prepare(
            "SELECT a.updated_at - a.created_at FROM assignments a JOIN rounds r
             ON a.round_id = r.id WHERE r.task_id = ?1 AND a.state = 'COMPLETED'",
        )
        .unwrap();
    let recorded = statement
        .query_map([&task], |row| row.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    (summary, recorded)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_amplifier_is_sent_at_each_devices_drawn_instant_whichever_side_of_theta() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data")).await;
    let maxima = feature_0_maxima(DEVICES);
    let lowest = maxima.iter().copied().fold(f32::INFINITY, f32::min);
    let highest = maxima.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for (population, theta, zeroed) in [
        ("amp-below", lowest / 2.0, DEVICES),
        ("amp-above", highest + 1.0, 0),
    ] {
        let (summary, mut recorded) = amplifier(&server, population, theta).await;
        assert_eq!(summary.contributions, DEVICES, "{population}");
        assert!(summary.failures.is_empty(), "{:?}", summary.failures);
        assert_eq!(
            summary.zeroed.len(),
            zeroed,
            "{population}: {:?}",
            summary.zeroed
        );
        // On the device: every seal started at its drawn instant, inside the window (and the
        // simulator's summary says so).
        let line = summary
            .send_instants()
            .expect("a line on the send instants");
        assert!(
            line.starts_with(&format!("send instants: {DEVICES} drawn ")),
            "{line}"
        );
        let mut drawn: Vec<i64> = summary.sends.iter().map(|s| s.drawn_ms).collect();
        assert_eq!(drawn.len(), DEVICES);
        for send in &summary.sends {
            assert!(
                (AMPLIFIER_WINDOW.0..=AMPLIFIER_WINDOW.1).contains(&send.drawn_ms),
                "{population}: {send:?}"
            );
            assert!(
                send.started_late_by.as_millis() < JITTER_MS as u128,
                "{population}: {send:?}"
            );
        }
        // At the operator: each assignment's created -> completed is one device's drawn instant
        // plus the round trips (matched in order: the smallest with the smallest).
        drawn.sort_unstable();
        recorded.sort_unstable();
        assert_eq!(recorded.len(), DEVICES, "{population}");
        for (drawn, recorded) in drawn.iter().zip(&recorded) {
            assert!(
                (0..JITTER_MS).contains(&(recorded - drawn)),
                "{population}: drawn {drawn} ms, recorded {recorded} ms"
            );
        }
    }
    server.stop().await;
}
