//! The `confed-enclave` binary as a separate process (as in Confidential Space, with the dev
//! attester standing in): it reaches the server only through the worker API and the key services
//! only over HTTP, and completes a round.

use crate::common;

use std::process::Stdio;
use std::time::Duration;

use common::system::{
    collect, collect_n, get, now_clock, open_task_of, open_task_with, rounds, start_full,
    start_partitioned,
};
use confed::aggregation::partitions::PartitionPolicy;
use confed::embedded::EmbeddedSystem;
use p256::pkcs8::{EncodePrivateKey, LineEnding};

const TOKEN: &str = "worker-token-for-process-tests-0123456789ab";

/// A `confed-enclave` process for `system`, trusted through the dev attester's key in
/// `key_file`, its stderr piped.
fn enclave_command(
    binary: &std::path::Path,
    system: &EmbeddedSystem,
    key_file: &std::path::Path,
    id: &str,
) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(binary);
    command
        .args([
            "--server",
            &system.url,
            "--threshold",
            "2",
            "--attester",
            "dev",
        ])
        .args(["--id", id, "--ops-listen", "127.0.0.1:0", "--dev-key"])
        .arg(key_file)
        .env("CONFED_WORKER_TOKEN", TOKEN)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for service in &system.keyservices {
        command.args(["--keyservice", &format!("{}={}", service.id, service.url)]);
    }
    command
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_enclave_binary_completes_a_round_through_the_worker_api() {
    let binary = common::enclave_binary();
    let key = confed_attestation::exchange::generate_signing_key();
    let (system, dir) = start_full(now_clock(), Some(TOKEN), Some(key.clone())).await;
    let key_file = dir.path().join("dev-attester.pem");
    std::fs::write(
        &key_file,
        key.to_pkcs8_pem(LineEnding::LF).unwrap().as_bytes(),
    )
    .unwrap();
    // FedAdam: the worker reads the optimizer's state of the previous round and stores the
    // next one through the worker API (`PUT .../optimizer-state`, then the model naming it).
    let (token, task) = open_task_with(
        &system,
        "process",
        8.0,
        serde_json::json!({"server_optimizer": {"name": "fedadam", "tau": 0.01}}),
    )
    .await;
    let mut stderr = String::new();
    for round in 1..=2u64 {
        collect(&system, "process", 5 + round, false).await;
        let mut command = enclave_command(&binary, &system, &key_file, "enclave-process-1");
        command.arg("--once");
        let output = tokio::time::timeout(Duration::from_secs(120), command.output())
            .await
            .expect("confed-enclave finished")
            .unwrap();
        stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(output.status.success(), "round {round}: {stderr}");
    }
    // Each model version is FedAdam's step from the previous one with the round's release,
    // the moments carried from round 1 to round 2 by the stored state.
    let bytes = |path: String| {
        let (system, token) = (&system, &token);
        async move {
            get(system, token, &path)
                .await
                .bytes()
                .await
                .unwrap()
                .to_vec()
        }
    };
    let optimizer = confed_worker_api::optimizer::ServerOptimizer::FedAdam {
        beta1: 0.9,
        beta2: 0.99,
        tau: 0.01,
    };
    let mut model = bytes(format!("/v1/tasks/{task}/models/0")).await;
    let mut state: Option<Vec<u8>> = None;
    for round in 1..=2 {
        let schema = confed_worker_api::model::validate_model(&model).unwrap();
        let average = bytes(format!("/v1/tasks/{task}/releases/{round}/average")).await;
        let values = confed_enclave::updater::average_values(&schema, &average).unwrap();
        let expected = confed_enclave::updater::apply_with(
            &model,
            &schema,
            &values,
            1.0,
            &optimizer,
            state.as_deref(),
        )
        .unwrap();
        model = bytes(format!("/v1/tasks/{task}/models/{round}")).await;
        assert_eq!(
            model, expected.model,
            "model version {round} is FedAdam's step"
        );
        state = expected.optimizer_state;
    }
    // It said loudly that its attestation proves nothing.
    assert!(stderr.contains("DEV ATTESTER"));
    assert!(
        !stderr.contains('\u{1b}'),
        "no colour codes in a log that is not a terminal: {stderr}"
    );
    let states = rounds(&system, &token, &task).await;
    assert_eq!(states[0]["state"], "COMPLETED", "{states:?}");
    let releases: serde_json::Value = get(&system, &token, &format!("/v1/tasks/{task}/releases"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(releases["releases"][0]["included"], common::system::GOAL);
    assert!(dir.path().join("dev-attester.jwks.json").exists());
    // What the process released verifies offline against the devices' trust file.
    let trust = dir.path().join("trust.json");
    std::fs::write(&trust, serde_json::to_vec(&system.trust).unwrap()).unwrap();
    let verified = confed::verify::verify_release(
        &system.url,
        &token,
        &task,
        1,
        &confed_device::load_trust(&trust).unwrap(),
    )
    .await
    .unwrap();
    assert!(verified.ok(), "{:?}", verified.lines);
    system.shutdown().await;
}

/// Issue 33's failover: a `confed-enclave` process holding a partition's lease is killed with
/// SIGKILL before it stored anything; once its lease lapses (by the server's clock) the partition
/// is leased again, and the round releases every contribution exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confed_enclave_killed_mid_partition_loses_nothing_and_counts_nothing_twice() {
    let binary = common::enclave_binary();
    let key = confed_attestation::exchange::generate_signing_key();
    let clock = now_clock();
    // 100 contributions in two partitions of 50, the enclave's smallest.
    let devices = 100;
    let partitioning = PartitionPolicy {
        workers: 2,
        min_contributions: 50,
    };
    let (system, dir) =
        start_partitioned(clock.clone(), Some(TOKEN), Some(key.clone()), partitioning).await;
    let key_file = dir.path().join("dev-attester.pem");
    std::fs::write(
        &key_file,
        key.to_pkcs8_pem(LineEnding::LF).unwrap().as_bytes(),
    )
    .unwrap();
    let (token, task) = open_task_of(&system, "killed", 8.0, devices).await;
    collect_n(&system, "killed", 3, false, devices).await;
    // Each try: a process leases a partition and is killed the moment the store shows it
    // holding one (polled, the process runs on its own); a process fast enough to store its
    // partition first is no failover, and the next try kills another.
    let mut killed_holding = None;
    for attempt in 0..5 {
        let name = format!("doomed-{attempt}");
        let mut child = enclave_command(&binary, &system, &key_file, &name)
            .args(["--lease-seconds", "10"])
            .spawn()
            .unwrap();
        let waiting = tokio::time::Instant::now();
        let held = loop {
            let partitions = system.db.round_partitions(&task, 1).await.unwrap();
            let holding = partitions.iter().find(|p| {
                p.sealed_key.is_none()
                    && p.lease_owner
                        .as_deref()
                        .is_some_and(|owner| owner.starts_with(&format!("{name}/")))
            });
            if let Some(partition) = holding {
                break partition.index;
            }
            assert!(
                waiting.elapsed() < Duration::from_secs(60),
                "{name} never leased a partition"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        child.start_kill().unwrap();
        child.wait().await.unwrap();
        let partitions = system.db.round_partitions(&task, 1).await.unwrap();
        if partitions[held as usize].sealed_key.is_none() {
            killed_holding = Some(held);
            break;
        }
    }
    let held = killed_holding.expect("a process was killed holding an unsealed partition");
    // The dead process's 10 s lease lapses (by the server's clock: the processes' own dev
    // tokens stay within the key services' age limit); `confed-enclave --once` processes take
    // what is left, a job each (the killed partition too, stored through `PUT .../partition`),
    // then the root, which fetches every sealed partition and releases.
    clock.advance(Duration::from_secs(11));
    let mut releases = Vec::new();
    for run in 0..6 {
        let mut command = enclave_command(&binary, &system, &key_file, "rescuer");
        command.arg("--once");
        let output = tokio::time::timeout(Duration::from_secs(120), command.output())
            .await
            .expect("confed-enclave finished")
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "run {run}: {stderr}");
        releases = system.db.releases_of_task(&task).await.unwrap();
        if !releases.is_empty() {
            break;
        }
    }
    let partitions = system.db.round_partitions(&task, 1).await.unwrap();
    assert!(partitions.iter().all(|p| p.sealed_key.is_some()));
    assert!(partitions[held as usize].lease_owner.is_none());
    assert_eq!(releases.len(), 1, "the root released");
    assert_eq!(releases[0].included, devices as i64);
    common::system::assert_released_every_contribution_once(&system, &task, devices).await;
    let states = rounds(&system, &token, &task).await;
    assert_eq!(states[0]["state"], "COMPLETED", "{states:?}");
    system.shutdown().await;
}
