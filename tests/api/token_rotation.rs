//! A token issuer's key rotation while tasks run (issue 46; docs/operations.md, "Rotating a token
//! issuer's key"). The reference device asks for a key that both the task's policy names and the
//! issuer's directory offers, whichever order the policy lists them in; a task that names only the
//! old key keeps filling its rounds while the issuer holds it beside the new one; and once the
//! issuer no longer holds any key a policy names, its devices fail their assignments and wait a
//! retry window before checking in again, never in a loop.

use crate::common;

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use common::issuer::{ISSUER, issuer_holding, signer};
use common::system::{GOAL, collect_trusting, now_clock, open_task_with, rounds, start};
use confed_protocol::privacy_pass::issuance::TokenSigner;
use confed_protocol::trust::TrustedIssuer;
use serde_json::json;

/// A second key whose truncated id differs from the test key's (an issuer refuses two alike).
fn next_key() -> TokenSigner {
    let old = signer().issuer_key().truncated_id();
    loop {
        let key = TokenSigner::generate().unwrap();
        if key.issuer_key().truncated_id() != old {
            return key;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_follow_a_key_rotation_and_tasks_on_the_old_key_keep_filling() {
    let clock = now_clock();
    let (system, _dir) = start(clock.clone()).await;
    let (old, new) = (signer(), next_key());
    let spki = |key: &TokenSigner| URL_SAFE_NO_PAD.encode(key.spki());
    let policy = |keys: &[&TokenSigner]| json!({"device_auth": {"issuer": ISSUER, "token_keys": keys.iter().map(|k| spki(k)).collect::<Vec<_>>()}});
    // The devices' trust file lists both keys (the operator published the next key first).
    let trusting = |url: &str| {
        let mut trust = system.trust.clone();
        trust.token_issuers.push(TrustedIssuer {
            name: ISSUER.into(),
            url: url.to_string(),
            token_keys: vec![spki(&old), spki(&new)],
        });
        trust
    };
    let fill = |population: &'static str, trust| {
        let system = &system;
        async move {
            collect_trusting(system, population, 3, false, GOAL, trust).await;
            let outcome = system
                .worker("w1")
                .run_once()
                .await
                .unwrap()
                .expect("a job");
            assert_eq!(outcome.included, GOAL as u64, "{population}");
        }
    };

    // Before: the issuer holds the old key. A task naming the next key first still fills (the
    // devices ask for the key the issuer offers), as does one naming only the old key.
    let states = [(); 3].map(|_| tempfile::tempdir().unwrap());
    let before = issuer_holding(states[0].path(), clock.clone(), vec![signer()], 4).await;
    open_task_with(&system, "next-first", 50.0, policy(&[&new, &old])).await;
    fill("next-first", trusting(&before)).await;
    let (token, long_running) = open_task_with(&system, "old-only", 50.0, policy(&[&old])).await;
    fill("old-only", trusting(&before)).await;

    // During: the issuer holds the new key first and the old one beside it. The old task's next
    // round fills; a new task naming the new key first fills too.
    let during = issuer_holding(
        states[1].path(),
        clock.clone(),
        vec![next_key_clone(&new), signer()],
        4,
    )
    .await;
    fill("old-only", trusting(&during)).await;
    open_task_with(&system, "new-first", 50.0, policy(&[&old, &new])).await;
    fill("new-first", trusting(&during)).await;
    let listed = rounds(&system, &token, &long_running).await;
    let states: Vec<&str> = listed.iter().filter_map(|r| r["state"].as_str()).collect();
    assert!(
        states.len() >= 2 && !states.contains(&"FAILED"),
        "no round of the old task failed during the rotation: {states:?}"
    );

    let states_after = tempfile::tempdir().unwrap();
    // After: the issuer holds only the new key. A task naming only the old key gets no tokens:
    // its devices fail their assignments and wait before checking in again.
    let after = issuer_holding(
        states_after.path(),
        clock.clone(),
        vec![next_key_clone(&new)],
        4,
    )
    .await;
    open_task_with(&system, "stranded", 50.0, policy(&[&old])).await;
    let summary = confed::tools::simulate::run(confed::tools::simulate::SimulationConfig {
        server: system.url.clone(),
        population: "stranded".into(),
        devices: 2,
        first_device: 0,
        concurrency: 2,
        rounds: 1,
        trust: trusting(&after),
        train: false,
        seed: 5,
        rows_per_device: 40,
        max_retry_wait: Duration::from_millis(20),
        idle_limit: 3,
        client_version: "1.0.0".into(),
        progress: false,
        bars: None,
        state_dir: None,
        analytics: None,
    })
    .await
    .unwrap();
    assert_eq!(summary.contributions, 0);
    assert!(
        !summary.failures.is_empty()
            && summary.failures.len() <= 2 * 3
            && summary.failures.iter().all(|f| f.contains("offers none")),
        "{:?}",
        summary.failures
    );
    system.shutdown().await;
}

/// The same key again (a signer is not `Clone`: through its PEM).
fn next_key_clone(key: &TokenSigner) -> TokenSigner {
    TokenSigner::from_pem(&key.to_pem().unwrap()).unwrap()
}
