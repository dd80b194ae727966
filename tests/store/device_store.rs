//! The device store's conformance suite: the same device-path cases on every engine (SQLite
//! always; PostgreSQL too when `CONFED_TEST_DATABASE_URL` names a server, as on the CI's second
//! pass). Each engine has its own statements (`src/db/sqlite/device.rs`,
//! `src/db/postgres/device.rs`); these cases pin down that they mean the same thing.

use crate::common;

use common::{START_MILLIS, TestApp};
use confed::db::device::{Capability, Refusal, ReportOutcome, Stored, UploadDigests};
use confed::db::jobs::StoredContribution;
use confed::states::{AssignmentState, RoundState};
use serde_json::json;

const NOW: i64 = START_MILLIS + 1_000;
const EXPIRES: i64 = START_MILLIS + 60_000;

/// A tenant, an open task (report goal `goal`) and its collecting round: (task id, round id).
async fn collecting_round(app: &TestApp, goal: i64) -> (String, String) {
    let token = app.tenant("acme").await;
    let task = app
        .open_task(&token, json!({"report_goal": goal, "min_reports": 1}))
        .await;
    let tenant = app.db.list_tenants().await.unwrap().remove(0);
    let round = app.db.rounds(&tenant.id, &task).await.unwrap().remove(0);
    assert_eq!(round.state, RoundState::Collecting);
    (task, round.id)
}

fn cap(text: &str) -> Capability {
    Capability::from(text)
}

/// Takes a slot with the capability `capability` (capacity `capacity`, key `k1`).
async fn assign(app: &TestApp, round: &str, capacity: u64, capability: &str) -> bool {
    app.db
        .assign(round, capacity, &cap(capability), EXPIRES, "k1")
        .await
        .unwrap()
        .is_some()
}

/// An upload at `at` (the store's time is the app's clock).
async fn upload(app: &TestApp, capability: &str, digest: &str, at: i64) -> Result<Stored, Refusal> {
    app.clock.set(confed::clock::Millis(at));
    app.db
        .record_upload(
            &cap(capability),
            UploadDigests {
                idempotency: digest,
                blake3_hex: Some(digest),
            },
            100,
            &format!("blob/{capability}"),
        )
        .await
        .unwrap()
}

async fn report(
    app: &TestApp,
    capability: &str,
    outcome: ReportOutcome,
    at: i64,
) -> Result<AssignmentState, Refusal> {
    app.clock.set(confed::clock::Millis(at));
    app.db
        .record_report(&cap(capability), outcome, Some("out of memory"))
        .await
        .unwrap()
}

/// Live assignments of the population's only collecting round.
async fn live(app: &TestApp) -> i64 {
    let candidates = app.db.checkin_candidates("phones.en").await.unwrap();
    candidates.first().map_or(-1, |c| c.live)
}

#[tokio::test]
async fn concurrent_check_ins_never_overfill_a_round() {
    for (engine, app) in TestApp::on_each_engine().await {
        let (_, round) = collecting_round(&app, 10).await;
        let attempts = (0..24).map(|i| {
            let app = &app;
            let round = round.clone();
            async move { assign(app, &round, 7, &format!("cap-{i}")).await }
        });
        let taken = futures_util::future::join_all(attempts)
            .await
            .into_iter()
            .filter(|t| *t)
            .count();
        assert_eq!(taken, 7, "{engine}");
        assert_eq!(live(&app).await, 7, "{engine}");
    }
}

/// Writes that share a transaction (PostgreSQL's group commit, SQLite's writer batch) fail
/// alone: a capability taken twice at once gets a database error (the assignment's primary
/// key), and every other check-in of the burst still takes its slot, durably.
#[tokio::test]
async fn a_failing_write_in_a_burst_fails_alone() {
    for (engine, app) in TestApp::on_each_engine().await {
        let (_, round) = collecting_round(&app, 100).await;
        let names: Vec<String> = (0..12)
            .map(|i| format!("burst-{}", if i == 7 { 3 } else { i }))
            .collect();
        let attempts = names.iter().map(|name| {
            let (app, round) = (&app, &round);
            async move {
                app.db
                    .assign(round, 100, &cap(name), EXPIRES, "k1")
                    .await
                    .map(|assigned| assigned.is_some())
            }
        });
        let answers = futures_util::future::join_all(attempts).await;
        let failed = answers.iter().filter(|a| a.is_err()).count();
        let taken = answers.iter().filter(|a| matches!(a, Ok(true))).count();
        assert_eq!((failed, taken), (1, 11), "{engine}: {answers:?}");
        assert_eq!(
            live(&app).await,
            11,
            "{engine}: the failed one took no slot"
        );
        for i in (0..12).filter(|i| *i != 7) {
            assert_eq!(
                upload(&app, &format!("burst-{i}"), "d", NOW).await,
                Ok(Stored::New),
                "{engine}: burst-{i} holds its assignment"
            );
        }
    }
}

/// A device chooses its error text: control characters (a NUL, which PostgreSQL refuses in
/// text) are replaced, and the report is recorded like any other.
#[tokio::test]
async fn a_failure_report_with_control_characters_in_its_text_is_recorded() {
    for (engine, app) in TestApp::on_each_engine().await {
        let (_, round) = collecting_round(&app, 10).await;
        assert!(assign(&app, &round, 10, "nul").await);
        let recorded = app
            .db
            .record_report(&cap("nul"), ReportOutcome::Failed, Some("bad\0byte\u{7}\n"))
            .await
            .unwrap();
        assert_eq!(recorded, Ok(AssignmentState::Failed), "{engine}");
    }
}

#[tokio::test]
async fn the_first_assignment_fixes_the_rounds_key() {
    for (engine, app) in TestApp::on_each_engine().await {
        let (_, round) = collecting_round(&app, 10).await;
        let first = app
            .db
            .assign(&round, 10, &cap("a"), EXPIRES, "k1")
            .await
            .unwrap()
            .unwrap();
        let second = app
            .db
            .assign(&round, 10, &cap("b"), EXPIRES, "k2")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (first.key_id.as_str(), second.key_id.as_str()),
            ("k1", "k1"),
            "{engine}"
        );
        let view = app.db.assignment(&cap("b")).await.unwrap().unwrap();
        assert_eq!(view.state, AssignmentState::Assigned, "{engine}");
        assert_eq!(view.key_id.as_deref(), Some("k1"), "{engine}");
        assert!(
            app.db
                .assignment(&cap("never-issued"))
                .await
                .unwrap()
                .is_none(),
            "{engine}"
        );
    }
}

#[tokio::test]
async fn an_upload_is_stored_once_repeated_idempotently_and_refused_otherwise() {
    for (engine, app) in TestApp::on_each_engine().await {
        let (_, round) = collecting_round(&app, 10).await;
        assert!(assign(&app, &round, 10, "a").await);
        assert_eq!(
            upload(&app, "a", "d1", NOW).await,
            Ok(Stored::New),
            "{engine}"
        );
        assert_eq!(
            upload(&app, "a", "d1", NOW).await,
            Ok(Stored::Again),
            "{engine}"
        );
        assert_eq!(
            upload(&app, "a", "d2", NOW).await,
            Err(Refusal::DifferentBytes),
            "{engine}"
        );
        assert_eq!(
            upload(&app, "unknown", "d1", NOW).await,
            Err(Refusal::UnknownAssignment),
            "{engine}"
        );
        assert!(assign(&app, &round, 10, "late").await);
        assert_eq!(
            upload(&app, "late", "d1", EXPIRES).await,
            Err(Refusal::Expired),
            "{engine}: at the expiry"
        );
        let view = app.db.assignment(&cap("a")).await.unwrap().unwrap();
        assert_eq!(view.state, AssignmentState::Uploaded, "{engine}");
        assert_eq!(view.contribution_digest.as_deref(), Some("d1"), "{engine}");
    }
}

#[tokio::test]
async fn reports_follow_the_assignment_machine_and_repeat_idempotently() {
    use ReportOutcome::*;
    for (engine, app) in TestApp::on_each_engine().await {
        let (_, round) = collecting_round(&app, 10).await;
        for capability in ["a", "b", "c"] {
            assert!(assign(&app, &round, 10, capability).await);
        }
        assert_eq!(
            report(&app, "a", Completed, NOW).await,
            Err(Refusal::NotUploaded),
            "{engine}: completed before the upload"
        );
        assert_eq!(
            report(&app, "a", Failed, NOW).await,
            Ok(AssignmentState::Failed)
        );
        assert_eq!(
            report(&app, "a", Failed, NOW).await,
            Ok(AssignmentState::Failed),
            "{engine}: the same report again"
        );
        assert_eq!(
            report(&app, "a", NotEligible, NOW).await,
            Err(Refusal::Finished(AssignmentState::Failed)),
            "{engine}"
        );
        assert_eq!(
            report(&app, "b", NotEligible, NOW).await,
            Ok(AssignmentState::Rejected),
            "{engine}"
        );
        assert_eq!(upload(&app, "c", "d", NOW).await, Ok(Stored::New));
        assert_eq!(
            report(&app, "c", Completed, NOW).await,
            Ok(AssignmentState::Completed)
        );
        assert_eq!(
            report(&app, "c", Completed, NOW).await,
            Ok(AssignmentState::Completed),
            "{engine}: a repeated completion"
        );
        assert_eq!(
            report(&app, "unknown", Failed, NOW).await,
            Err(Refusal::UnknownAssignment),
            "{engine}"
        );
        // A failed or rejected assignment frees its slot; a completed one keeps it.
        assert_eq!(live(&app).await, 1, "{engine}");
        let history: Vec<String> = app
            .db
            .history(cap("c").reference().as_str())
            .await
            .unwrap()
            .into_iter()
            .map(|h| h.to_state)
            .collect();
        assert_eq!(history, ["ASSIGNED", "UPLOADED", "COMPLETED"], "{engine}");
        let failed: Vec<(Option<String>, String, String)> = app
            .db
            .history(cap("a").reference().as_str())
            .await
            .unwrap()
            .into_iter()
            .map(|h| (h.from_state, h.to_state, h.reason))
            .collect();
        assert_eq!(
            failed,
            [
                (None, "ASSIGNED".into(), "device checked in".into()),
                (
                    Some("ASSIGNED".into()),
                    "FAILED".into(),
                    "device reported failure".into()
                ),
            ],
            "{engine}"
        );
    }
}

#[tokio::test]
async fn concurrent_completions_close_the_round_once_with_one_job() {
    for (engine, app) in TestApp::on_each_engine().await {
        let (task, round) = collecting_round(&app, 5).await;
        // On PostgreSQL, another replica on the same database hears of the close too.
        let replica = match &app.database_url {
            Some(url) if engine == "postgres" => Some(
                confed::db::Db::open_postgres(url)
                    .await
                    .unwrap()
                    .with_clock(app.clock.clone()),
            ),
            _ => None,
        };
        for i in 0..8 {
            let capability = format!("cap-{i}");
            assert!(assign(&app, &round, 8, &capability).await);
            assert_eq!(upload(&app, &capability, "d", NOW).await, Ok(Stored::New));
        }
        let reports = (0..8).map(|i| {
            let app = &app;
            async move { report(app, &format!("cap-{i}"), ReportOutcome::Completed, NOW).await }
        });
        let answers = futures_util::future::join_all(reports).await;
        let completed = answers
            .iter()
            .filter(|a| **a == Ok(AssignmentState::Completed))
            .count();
        let closed = answers
            .iter()
            .filter(|a| **a == Err(Refusal::RoundClosed))
            .count();
        // The goal's report closes the round; later ones find it closed (the serial writer may
        // also have applied them all before: never more completions than the goal).
        assert_eq!(completed, 5, "{engine}: {answers:?}");
        assert_eq!(closed, 3, "{engine}: {answers:?}");
        // The close wakes an in-process worker at once (a permit waits if none is waiting).
        tokio::time::timeout(std::time::Duration::from_secs(10), app.db.job_ready())
            .await
            .unwrap_or_else(|_| panic!("{engine}: closing the round signalled no job"));
        if let Some(replica) = &replica {
            tokio::time::timeout(std::time::Duration::from_secs(10), replica.job_ready())
                .await
                .expect("another replica hears of the close (LISTEN/NOTIFY)");
        }
        let tenant = app.db.list_tenants().await.unwrap().remove(0);
        let rounds = app.db.rounds(&tenant.id, &task).await.unwrap();
        assert_eq!(rounds[0].state, RoundState::Aggregating, "{engine}");
        assert_eq!(rounds[0].reports_received, 5, "{engine}");
        let first = app
            .db
            .lease_job("w1/1", std::time::Duration::from_secs(60))
            .await
            .unwrap();
        assert!(first.is_some(), "{engine}: the round's job");
        let second = app
            .db
            .lease_job("w2/1", std::time::Duration::from_secs(60))
            .await
            .unwrap();
        assert!(second.is_none(), "{engine}: one job per round");
        assert_eq!(
            upload(&app, "cap-0", "d", NOW).await,
            Ok(Stored::Again),
            "{engine}: the digest still answers a repeated upload"
        );
        assert!(
            !assign(&app, &round, 100, "after").await,
            "{engine}: closed"
        );
        for (i, answer) in answers.iter().enumerate() {
            let expected = match answer {
                Ok(_) => Err(Refusal::Finished(AssignmentState::Completed)),
                Err(_) => Err(Refusal::RoundClosed),
            };
            assert_eq!(
                report(&app, &format!("cap-{i}"), ReportOutcome::Failed, NOW).await,
                expected,
                "{engine}: a failure report after the round closed"
            );
        }
    }
}

/// A listing's (blob key, digest) pairs, sorted.
fn keys_and_digests(listed: &[StoredContribution]) -> Vec<(&str, Option<&str>)> {
    let mut pairs: Vec<(&str, Option<&str>)> = listed
        .iter()
        .map(|c| (c.blob_key.as_str(), c.blake3_hex.as_deref()))
        .collect();
    pairs.sort_unstable();
    pairs
}

/// The BLAKE3 recorded with an upload through the server is what the round's job lists (the
/// enclave commits to it without reading the bytes first); a direct upload, whose bytes the
/// server never saw, is listed without one.
#[tokio::test]
async fn a_rounds_job_lists_the_digest_recorded_with_each_upload() {
    for (engine, app) in TestApp::on_each_engine().await {
        let (_, round) = collecting_round(&app, 2).await;
        for name in ["through", "direct"] {
            assert!(assign(&app, &round, 2, name).await);
        }
        assert_eq!(upload(&app, "through", "b3", NOW).await, Ok(Stored::New));
        let direct = app
            .db
            .record_upload(
                &cap("direct"),
                UploadDigests {
                    idempotency: "md5:00",
                    blake3_hex: None,
                },
                100,
                "blob/direct",
            )
            .await
            .unwrap();
        assert_eq!(direct, Ok(Stored::New), "{engine}");
        for name in ["through", "direct"] {
            assert_eq!(
                report(&app, name, ReportOutcome::Completed, NOW).await,
                Ok(AssignmentState::Completed),
                "{engine}"
            );
        }
        let contributions = app.db.job_contributions(&round).await.unwrap();
        assert_eq!(
            keys_and_digests(&contributions),
            [("blob/direct", None), ("blob/through", Some("b3"))],
            "{engine}"
        );
    }
}

/// A job's listing (JSON values the engine builds, a page at a time) comes back sorted by ref,
/// with each of the round's completed contributions once: nothing uploaded but not reported,
/// nothing of another round, the same in pages of two as in one.
#[tokio::test]
async fn a_rounds_listing_is_sorted_by_ref_and_holds_only_its_completed_contributions() {
    for (engine, app) in TestApp::on_each_engine().await {
        let token = app.tenant("acme").await;
        let tenant = app.db.list_tenants().await.unwrap().remove(0);
        let mut rounds = Vec::new();
        for population in ["phones.de", "phones.en"] {
            let spec = json!({"report_goal": 8, "min_reports": 1, "population": population});
            let task = app.open_task(&token, spec).await;
            rounds.push(app.db.rounds(&tenant.id, &task).await.unwrap().remove(0).id);
        }
        let (other, round) = (&rounds[0], &rounds[1]);
        assert!(assign(&app, other, 8, "elsewhere").await, "{engine}");
        assert_eq!(
            upload(&app, "elsewhere", "digest-elsewhere", NOW).await,
            Ok(Stored::New)
        );
        assert_eq!(
            report(&app, "elsewhere", ReportOutcome::Completed, NOW).await,
            Ok(AssignmentState::Completed)
        );
        let names = ["q", "Zed-1", "a", "b-2", "M", "pending"];
        for name in names {
            assert!(assign(&app, round, 8, name).await, "{engine}");
            assert_eq!(
                upload(&app, name, &format!("digest-{name}"), NOW).await,
                Ok(Stored::New),
                "{engine}"
            );
        }
        for name in &names[..5] {
            assert_eq!(
                report(&app, name, ReportOutcome::Completed, NOW).await,
                Ok(AssignmentState::Completed),
                "{engine}"
            );
        }
        let listed = app.db.job_contributions(round).await.unwrap();
        let refs: Vec<&str> = listed.iter().map(|c| c.assignment_ref.as_str()).collect();
        let mut sorted = refs.clone();
        sorted.sort_unstable();
        assert_eq!(refs, sorted, "{engine}: sorted bytewise");
        assert_eq!(
            keys_and_digests(&listed),
            [
                ("blob/M", Some("digest-M")),
                ("blob/Zed-1", Some("digest-Zed-1")),
                ("blob/a", Some("digest-a")),
                ("blob/b-2", Some("digest-b-2")),
                ("blob/q", Some("digest-q")),
            ],
            "{engine}"
        );
        for page in [1, 2, 5] {
            let paged = app
                .db
                .job_contributions_in_pages(round, page)
                .await
                .unwrap();
            assert_eq!(paged, listed, "{engine}: pages of {page}");
        }
        let empty = app.db.job_contributions("no-such-round").await.unwrap();
        assert!(empty.is_empty(), "{engine}: a round with nothing listed");
    }
}

#[tokio::test]
async fn check_in_sees_only_collecting_rounds_of_open_tasks_of_the_populations_owner() {
    for (engine, app) in TestApp::on_each_engine().await {
        assert!(
            app.db
                .checkin_candidates("phones.en")
                .await
                .unwrap()
                .is_empty()
        );
        let (task, round) = collecting_round(&app, 10).await;
        let candidates = app.db.checkin_candidates("phones.en").await.unwrap();
        assert_eq!(candidates.len(), 1, "{engine}");
        assert_eq!(
            (
                candidates[0].task_id.as_str(),
                candidates[0].round_id.as_str()
            ),
            (task.as_str(), round.as_str())
        );
        assert_eq!(candidates[0].round_number, 1, "{engine}");
        assert!(
            app.db
                .checkin_candidates("tablets")
                .await
                .unwrap()
                .is_empty(),
            "{engine}"
        );
    }
}

#[tokio::test]
async fn expired_assignments_time_out_and_free_their_slots() {
    for (engine, app) in TestApp::on_each_engine().await {
        let (_, round) = collecting_round(&app, 10).await;
        assert!(assign(&app, &round, 2, "a").await);
        assert!(assign(&app, &round, 2, "b").await);
        assert!(!assign(&app, &round, 2, "c").await, "{engine}: full");
        assert_eq!(upload(&app, "b", "d", NOW).await, Ok(Stored::New));
        app.clock.set(confed::clock::Millis(EXPIRES));
        assert_eq!(app.db.expire_assignments(100).await.unwrap(), 2, "{engine}");
        assert_eq!(live(&app).await, 0, "{engine}");
        assert_eq!(
            report(&app, "b", ReportOutcome::Completed, EXPIRES + 1).await,
            Err(Refusal::Expired),
            "{engine}: a timed-out assignment is expired (410), as on the upload route"
        );
        assert!(assign(&app, &round, 2, "c").await, "{engine}: a freed slot");
    }
}

/// A round of goal 2 that two devices filled: closed, its job waiting for a lease.
async fn closed_round_of_two(app: &TestApp) -> String {
    let (_, round) = collecting_round(app, 2).await;
    for device in ["a", "b"] {
        assert!(assign(app, &round, 2, device).await);
        assert_eq!(upload(app, device, "d", NOW).await, Ok(Stored::New));
        assert_eq!(
            report(app, device, ReportOutcome::Completed, NOW).await,
            Ok(AssignmentState::Completed)
        );
    }
    round
}

/// A deployment that never cuts rounds into partitions has the lease plan its job whole, in the
/// lease's own transaction (one commit fewer on each round's path). A plan once made is what
/// every later lease finds, and a lease that plans nothing leaves an unplanned job unplanned for
/// its caller to plan.
#[tokio::test]
async fn a_lease_can_plan_its_job_whole_and_every_later_lease_finds_the_plan() {
    use confed::db::jobs::LeasePlan::{Later, Whole};
    const LEASE: std::time::Duration = std::time::Duration::from_secs(60);
    for (engine, app) in TestApp::on_each_engine().await {
        let round = closed_round_of_two(&app).await;
        let lease = |worker: &'static str, at: i64, plan| {
            app.clock.set(confed::clock::Millis(at));
            let db = app.db.clone();
            async move {
                db.lease_job_planning(worker, at, LEASE, plan)
                    .await
                    .unwrap()
                    .unwrap_or_else(|| panic!("{engine}: {worker} leases the round's job"))
            }
        };
        let first = lease("w1/1", NOW, Later).await;
        assert_eq!(first.plan, None, "{engine}: left for the caller to plan");
        // Each lease after the one before lapsed.
        let second = lease("w2/1", NOW + 61_000, Whole).await;
        assert_eq!(second.plan, Some(1), "{engine}: planned whole by the lease");
        app.db.plan_job(&round, &second.holder, 3).await.unwrap();
        assert!(
            app.db.partitions(&round).await.unwrap().is_empty(),
            "{engine}: a plan once made is kept"
        );
        let third = lease("w3/1", NOW + 122_000, Later).await;
        assert_eq!(third.plan, Some(1), "{engine}: every later lease finds it");
    }
}

/// A `Whole` lease only fills a plan that is missing: a job already cut into partitions (by a
/// replica that may cut rounds) keeps its plan and its partitions when a replica that never cuts
/// leases its root.
#[tokio::test]
async fn a_whole_lease_keeps_a_job_already_cut_into_partitions() {
    use confed::db::jobs::LeasePlan::{Later, Whole};
    const LEASE: std::time::Duration = std::time::Duration::from_secs(60);
    for (engine, app) in TestApp::on_each_engine().await {
        let round = closed_round_of_two(&app).await;
        let first = app
            .db
            .lease_job_planning("w1/1", NOW, LEASE, Later)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{engine}: the round's job"));
        app.db.plan_job(&round, &first.holder, 3).await.unwrap();
        for worker in ["p1/1", "p2/1", "p3/1"] {
            let partition = app
                .db
                .lease_partition_for(worker, NOW, LEASE)
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("{engine}: a partition for {worker}"));
            let sealed = format!("sealed/{}", partition.index);
            app.db
                .store_partition(&round, partition.index, &partition.holder, &sealed)
                .await
                .unwrap();
        }
        let root = app
            .db
            .lease_job_planning("w2/1", NOW, LEASE, Whole)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{engine}: the root, every partition stored"));
        assert_eq!(root.plan, Some(3), "{engine}: the plan stays");
        assert_eq!(
            app.db.partitions(&round).await.unwrap().len(),
            3,
            "{engine}: and so do its partitions"
        );
    }
}
