//! Several replicas on one PostgreSQL database: two `Db` handles (two connection pools, as two
//! server processes have) race for the same rows. Runs when `CONFED_TEST_DATABASE_URL` names a
//! PostgreSQL server (`.ci/run` starts one); otherwise it says, once, that it did not run.
//! SQLite needs no such test: one writer thread applies every write of its one process.

mod common;

use std::io::Write;

use common::{START_MILLIS, TestApp};
use confed::db::Db;
use confed::db::device::UploadDigests;
use confed::states::RoundState;
use confed_protocol::device::ReportOutcome;
use confed_protocol::ids::Capability;
use serde_json::json;

/// Two handles on the same PostgreSQL database, and the round a fresh task opened; `None`
/// (after saying so on the terminal, past the test harness's capture) without PostgreSQL.
async fn replicas(report_goal: i64) -> Option<(TestApp, Db, String, String)> {
    let app = TestApp::new().await;
    let Some(url) = app.database_url.clone() else {
        static NOTICE: std::sync::Once = std::sync::Once::new();
        NOTICE.call_once(|| {
            let _ = writeln!(
                std::io::stderr(),
                "\nNOTE: the PostgreSQL cases were NOT run: set {}=postgres://... \
                 (deploy/local/postgres.sh start DIR starts a throwaway server; .ci/run does)\n",
                common::database::POSTGRES_ENV
            );
        });
        return None;
    };
    let replica = Db::open_postgres(&url).await.unwrap();
    let token = app.tenant("acme").await;
    let task = app
        .open_task(
            &token,
            json!({"report_goal": report_goal, "min_reports": 1, "over_selection": 0.0}),
        )
        .await;
    let tenant = app.db.list_tenants().await.unwrap().remove(0);
    let round = app.db.rounds(&tenant.id, &task).await.unwrap().remove(0);
    Some((app, replica, task, round.id))
}

fn capability(i: usize) -> Capability {
    Capability::new(format!(
        "capability-{i:04}-0123456789abcdef0123456789abcdef"
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_never_overfill_a_round() {
    let Some((app, replica, _task, round_id)) = replicas(20).await else {
        return;
    };
    let expires = START_MILLIS + 60_000;
    let attempts = (0..100).map(|i| {
        let db = if i % 2 == 0 {
            app.db.clone()
        } else {
            replica.clone()
        };
        let round_id = round_id.clone();
        tokio::spawn(async move {
            db.assign(&round_id, 20, &capability(i), expires, "k1", START_MILLIS)
                .await
                .unwrap()
        })
    });
    let mut assigned = 0;
    for attempt in attempts {
        if attempt.await.unwrap().is_some() {
            assigned += 1;
        }
    }
    assert_eq!(assigned, 20, "capacity is 20 whatever the replica");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_reports_close_the_round_once_and_one_worker_leases_its_job() {
    let Some((app, replica, task, round_id)) = replicas(10).await else {
        return;
    };
    let dbs = [app.db.clone(), replica.clone()];
    let now = START_MILLIS + 1;
    for i in 0..10 {
        let db = &dbs[i % 2];
        db.assign(
            &round_id,
            10,
            &capability(i),
            START_MILLIS + 60_000,
            "k1",
            START_MILLIS,
        )
        .await
        .unwrap()
        .expect("a slot");
        let digest = format!("{i:064x}");
        let digests = UploadDigests {
            idempotency: &digest,
            blake3_hex: Some(&digest),
        };
        db.record_upload(&capability(i), digests, 100, "log/x", now)
            .await
            .unwrap()
            .unwrap();
    }
    let reports = (0..10).map(|i| {
        let db = dbs[i % 2].clone();
        tokio::spawn(async move {
            db.record_report(&capability(i), ReportOutcome::Completed, None, now)
                .await
                .unwrap()
                .unwrap()
        })
    });
    for report in reports {
        report.await.unwrap();
    }
    let tenant = app.db.list_tenants().await.unwrap().remove(0);
    let round = app.db.rounds(&tenant.id, &task).await.unwrap().remove(0);
    assert_eq!(round.state, RoundState::Aggregating);
    assert_eq!(round.reports_received, 10);
    let closings = app
        .db
        .history(&round_id)
        .await
        .unwrap()
        .into_iter()
        .filter(|h| h.to_state == "AGGREGATING")
        .count();
    assert_eq!(closings, 1);

    let leases = ["worker-a", "worker-b", "worker-c", "worker-d"].map(|worker| {
        let db = dbs[worker.len() % 2].clone();
        tokio::spawn(async move { db.lease_job(worker, now, 60_000).await.unwrap() })
    });
    let mut leased = Vec::new();
    for lease in leases {
        leased.extend(lease.await.unwrap());
    }
    assert_eq!(leased.len(), 1, "one job, leased once: {leased:?}");
    assert_eq!(leased[0].round_id, round_id);
}
