//! Local retention: segments and rows were never deleted (5.8 GB of segments and a 589 MB
//! database after ten minutes of load), which led straight to a full disk. A closed round's
//! contributions are deleted once the retention window has passed, and nothing still needed
//! (a round still aggregating, its release, the models) is touched.

use crate::common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::system::{collect, get, now_clock, open_task, rounds};
use confed::clock::ManualClock;
use confed::embedded::{EmbeddedOptions, EmbeddedSystem};
use confed::retention::{Purged, Retention};

const WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);

async fn start_in(dir: &Path, clock: Arc<ManualClock>, database: Option<String>) -> EmbeddedSystem {
    EmbeddedSystem::start(EmbeddedOptions {
        // The contribution log (local): GCS expires objects by its own lifecycle rule.
        blobs: None,
        data_dir: dir.to_path_buf(),
        keyservices: 3,
        threshold: 2,
        clock,
        background_worker: false,
        scheduler_period: Duration::from_secs(3600),
        worker_token: None,
        attester_key: None,
        database,
        partitioning: Default::default(),
        ports: None,
    })
    .await
    .unwrap()
}

fn segments(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir.join("contributions"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("segment-"))
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_rounds_lose_their_contributions_after_the_window_and_nothing_needed_goes() {
    let clock = now_clock();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let database = match common::database::postgres_url() {
        Some(server) => Some(common::database::fresh_postgres_database(&server).await),
        None => None,
    };

    // Round 1 in the first process (segment 1), rounds 2 and 3 in the second (segment 2).
    let system = start_in(&data, clock.clone(), database.clone()).await;
    let (token, task) = open_task(&system, "kept", 8.0).await;
    collect(&system, "kept", 1, false).await;
    system
        .worker("w")
        .run_once()
        .await
        .unwrap()
        .expect("round 1");
    system.shutdown().await;
    let system = start_in(&data, clock.clone(), database).await;
    collect(&system, "kept", 2, false).await;
    system
        .worker("w")
        .run_once()
        .await
        .unwrap()
        .expect("round 2");
    collect(&system, "kept", 3, false).await; // round 3 waits for its aggregation
    assert_eq!(segments(&data).len(), 2);

    let retention = Retention::new(
        system.db.clone(),
        Some(system.store.contributions.clone()),
        WINDOW,
        Duration::ZERO,
    );
    assert_eq!(
        retention.run_once().await.unwrap(),
        Purged::default(),
        "within the window"
    );

    clock.advance(WINDOW + Duration::from_secs(3600));
    let purged = retention.run_once().await.unwrap();
    assert_eq!(
        purged,
        Purged {
            rounds: 2,
            storage_units: 1
        }
    );
    assert_eq!(
        segments(&data),
        ["segment-00000002.log"],
        "round 3's records are in segment 2"
    );

    // Round 3 still aggregates from its contributions; every release and model remains.
    let outcome = system
        .worker("w")
        .run_once()
        .await
        .unwrap()
        .expect("round 3");
    assert_eq!(outcome.included, common::system::GOAL as u64);
    let states = rounds(&system, &token, &task).await;
    assert!(
        states.iter().all(|r| r["state"] == "COMPLETED"),
        "{states:?}"
    );
    let releases: serde_json::Value = get(&system, &token, &format!("/v1/tasks/{task}/releases"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(releases["releases"].as_array().unwrap().len(), 3);
    for version in 1..=3 {
        let model = get(
            &system,
            &token,
            &format!("/v1/tasks/{task}/models/{version}"),
        )
        .await;
        assert_eq!(model.status(), 200, "model {version}");
    }

    // Once round 3's window passes too, only the segment being written remains.
    clock.advance(WINDOW + Duration::from_secs(3600));
    let purged = retention.run_once().await.unwrap();
    assert_eq!(purged.rounds, 1);
    assert_eq!(
        segments(&data),
        ["segment-00000002.log"],
        "the active segment is kept"
    );
    assert_eq!(system.db.oldest_log_key_in_use().await.unwrap(), None);
    system.shutdown().await;
}
