//! The `confed-enclave` binary as a separate process (as in Confidential Space, with the dev
//! attester standing in): it reaches the server only through the worker API and the key services
//! only over HTTP, and completes a round.

use crate::common;

use std::process::Stdio;
use std::time::Duration;

use common::system::{collect, get, now_clock, open_task_with, rounds, start_full};
use p256::pkcs8::{EncodePrivateKey, LineEnding};

const TOKEN: &str = "worker-token-for-process-tests-0123456789ab";

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
        let mut command = tokio::process::Command::new(&binary);
        command
            .args([
                "--server",
                &system.url,
                "--threshold",
                "2",
                "--attester",
                "dev",
                "--once",
            ])
            .args([
                "--id",
                "enclave-process-1",
                "--ops-listen",
                "127.0.0.1:0",
                "--dev-key",
            ])
            .arg(&key_file)
            .env("CONFED_WORKER_TOKEN", TOKEN)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for service in &system.keyservices {
            command.args(["--keyservice", &format!("{}={}", service.id, service.url)]);
        }
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
