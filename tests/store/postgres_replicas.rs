//! Several replicas on one PostgreSQL database: two `Db` handles (two connection pools, as two
//! server processes have) race for the same rows. Runs when `CONFED_TEST_DATABASE_URL` names a
//! PostgreSQL server (`.ci/run` starts one); otherwise it says, once, that it did not run.
//! SQLite needs no such test: one writer thread applies every write of its one process.

use crate::common;

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
    // Another replica on the same database, on the app's clock.
    let replica = Db::open_postgres(&url)
        .await
        .unwrap()
        .with_clock(app.clock.clone());
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
            db.assign(&round_id, 20, &capability(i), expires, "k1")
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
    app.clock.set(confed::clock::Millis(START_MILLIS + 1));
    for i in 0..10 {
        let db = &dbs[i % 2];
        db.assign(&round_id, 10, &capability(i), START_MILLIS + 60_000, "k1")
            .await
            .unwrap()
            .expect("a slot");
        let digest = format!("{i:064x}");
        let digests = UploadDigests {
            idempotency: &digest,
            blake3_hex: Some(&digest),
        };
        db.record_upload(&capability(i), digests, 100, "log/x")
            .await
            .unwrap()
            .unwrap();
    }
    let reports = (0..10).map(|i| {
        let db = dbs[i % 2].clone();
        tokio::spawn(async move {
            db.record_report(&capability(i), ReportOutcome::Completed, None)
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
        tokio::spawn(async move {
            db.lease_job(worker, std::time::Duration::from_secs(60))
                .await
                .unwrap()
        })
    });
    let mut leased = Vec::new();
    for lease in leases {
        leased.extend(lease.await.unwrap());
    }
    assert_eq!(leased.len(), 1, "one job, leased once: {leased:?}");
    assert_eq!(leased[0].round_id, round_id);
}

/// A PostgreSQL server of the test's own (so stopping it disturbs no other test), started with
/// `deploy/local/postgres.sh` like `.ci/run`'s.
struct OwnPostgres {
    dir: tempfile::TempDir,
    port: u16,
}

impl OwnPostgres {
    fn script() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/local/postgres.sh")
    }

    /// A port below the ephemeral range that nothing listens on now.
    fn free_port() -> u16 {
        let seed = std::process::id() as u16;
        (0..400)
            .map(|i| 16_000 + (seed.wrapping_add(i * 7)) % 4000)
            .find(|&port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
            .expect("a free port")
    }

    fn start_new() -> (Self, String) {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        // The server runs as `postgres` when the tests run as root: it must reach the directory.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let server = Self {
            dir,
            port: Self::free_port(),
        };
        let url = server.run("start");
        (server, url)
    }

    fn run(&self, command: &str) -> String {
        let output = std::process::Command::new(Self::script())
            .arg(command)
            .arg(self.dir.path().join("cluster"))
            .arg(self.port.to_string())
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "postgres.sh {command}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap().trim().to_string()
    }
}

impl Drop for OwnPostgres {
    fn drop(&mut self) {
        let _ = std::process::Command::new(Self::script())
            .arg("stop")
            .arg(self.dir.path().join("cluster"))
            .output();
    }
}

/// PostgreSQL stopped mid-round: every request that needs it fails fast with 503 and
/// `Retry-After` (not 30 s and a 500), `/healthz` stays 200 while `/readyz` says 503; once it is
/// back, the very next requests succeed (no 500 from connections broken under the pool) and the
/// round goes on with everything acknowledged before the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_stopped_mid_round_answers_503_fast_and_the_round_goes_on_when_it_returns() {
    if common::database::postgres_url().is_none() {
        return; // PostgreSQL is not installed here (`replicas` says so for this binary).
    }
    let (server, url) = OwnPostgres::start_new();
    let app = TestApp::on_postgres(&url).await;
    let token = app.tenant("acme").await;
    let task = app
        .open_task(
            &token,
            json!({"report_goal": 3, "min_reports": 1, "over_selection": 0.0}),
        )
        .await;
    let tenant = app.db.list_tenants().await.unwrap().remove(0);
    let round = app.db.rounds(&tenant.id, &task).await.unwrap().remove(0);
    // One device is done (acknowledged) before the outage.
    let expires = START_MILLIS + 600_000;
    app.db
        .assign(&round.id, 3, &capability(1), expires, "k1")
        .await
        .unwrap()
        .expect("a slot");
    let digest = format!("{:064x}", 1);
    let digests = UploadDigests {
        idempotency: &digest,
        blake3_hex: Some(&digest),
    };
    app.db
        .record_upload(&capability(1), digests, 100, "log/x")
        .await
        .unwrap()
        .unwrap();
    app.db
        .record_report(&capability(1), ReportOutcome::Completed, None)
        .await
        .unwrap()
        .unwrap();
    let task_path = format!("/v1/tasks/{task}");
    assert_eq!(
        app.call(axum::http::Method::GET, &task_path, Some(&token), None)
            .await
            .status,
        200
    );

    server.run("stop");
    for (path, tenant_token) in [
        (task_path.as_str(), Some(token.as_str())),
        ("/readyz", None),
    ] {
        let started = std::time::Instant::now();
        let reply = app
            .call(axum::http::Method::GET, path, tenant_token, None)
            .await;
        assert_eq!(
            reply.status,
            503,
            "{path}: {:?}",
            String::from_utf8_lossy(&reply.body)
        );
        assert!(reply.headers.contains_key("retry-after"), "{path}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{path} answered after {:?}, not within the pool's 2 s acquire timeout",
            started.elapsed()
        );
    }
    // /metrics still answers (a failing scrape would hide what the alerts need), not ready.
    let started = std::time::Instant::now();
    let metrics = app
        .call(axum::http::Method::GET, "/metrics", None, None)
        .await;
    assert_eq!(metrics.status, 200);
    assert!(
        String::from_utf8_lossy(&metrics.body).contains("\nconfed_ready{role=\"api\"} 0\n"),
        "{}",
        String::from_utf8_lossy(&metrics.body)
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    assert_eq!(app.check_in().await.status, 503, "check-in");
    let health = app
        .call(axum::http::Method::GET, "/healthz", None, None)
        .await;
    assert_eq!(
        health.status, 200,
        "liveness does not depend on the database"
    );

    server.run("start");
    for attempt in 0..5 {
        let reply = app
            .call(axum::http::Method::GET, &task_path, Some(&token), None)
            .await;
        assert_eq!(
            reply.status,
            200,
            "request {attempt} after PostgreSQL returned: {:?}",
            String::from_utf8_lossy(&reply.body)
        );
    }
    assert_eq!(
        app.call(axum::http::Method::GET, "/readyz", None, None)
            .await
            .status,
        200
    );
    let assigned = app.check_in().await;
    assert_eq!(
        assigned.status,
        200,
        "{:?}",
        String::from_utf8_lossy(&assigned.body)
    );
    let round = app.db.rounds(&tenant.id, &task).await.unwrap().remove(0);
    assert_eq!(round.state, RoundState::Collecting);
    assert_eq!(
        round.reports_received, 1,
        "the acknowledged report survived"
    );
}
