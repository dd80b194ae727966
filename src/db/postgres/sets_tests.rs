//! The sets' statements themselves, on a real PostgreSQL server (`CONFED_TEST_DATABASE_URL`, as
//! on the CI's PostgreSQL pass; without it these cases have nothing to run on and return). The
//! device store's suite (`tests/store/device_store.rs`) checks what callers see, but a set that
//! failed would fall back to the single statements there and pass unseen: here a failing
//! statement fails the case.

use sqlx::Row;

use super::{SetItem, SetOutcome, run};
use crate::db::device::{NewAssignment, NewUpload};
use crate::db::{Db, new_history_id};

const NOW: i64 = 1_800_000_000_000;

/// A collecting round `r1` of goal `goal` in a task of a tenant.
async fn collecting_round(db: &Db, goal: i64) {
    for statement in [
        "INSERT INTO tenants (id, name, token_id, token_sha256, max_active_tasks, \
         max_report_goal, created_at) VALUES ('t', 't', 'tok', 'x', 1, 1000, 0)"
            .to_string(),
        "INSERT INTO tasks (id, tenant_id, population, state, spec_json, created_at, \
         updated_at) VALUES ('task', 't', 'p', 'OPEN', '{}', 0, 0)"
            .to_string(),
        format!(
            "INSERT INTO rounds (id, task_id, round_number, attempt, state, report_goal, \
             min_reports, deadline_at, opened_at, updated_at) \
             VALUES ('r1', 'task', 1, 1, 'COLLECTING', {goal}, 1, {NOW} + 60000, 0, 0)"
        ),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(db.pool())
            .await
            .unwrap();
    }
}

fn assign(id: &str, capacity: i64) -> SetItem {
    SetItem::Assign {
        new: NewAssignment {
            round_id: "r1".into(),
            id: id.into(),
            capacity,
            key_if_unset: "k1".into(),
            expires_at: NOW + 30_000,
            now: NOW,
        },
        history_id: new_history_id(),
    }
}

fn upload(id: &str) -> SetItem {
    SetItem::Upload {
        upload: NewUpload {
            id: id.into(),
            sha256_hex: format!("blake3:{id}"),
            blake3_hex: Some(id.into()),
            size: 100,
            blob_key: format!("blob/{id}"),
            now: NOW + 1,
        },
        history_id: new_history_id(),
    }
}

fn complete(id: &str) -> SetItem {
    SetItem::Complete {
        id: id.into(),
        now: NOW + 2,
        history_id: new_history_id(),
    }
}

/// `items` as one batch's sets, committed.
async fn run_committed(db: &Db, items: &[SetItem]) -> Vec<Option<SetOutcome>> {
    let mut tx = db.pool().begin().await.unwrap();
    let items: Vec<Option<&SetItem>> = items.iter().map(Some).collect();
    let outcomes = run(&mut tx, &items).await.unwrap();
    tx.commit().await.unwrap();
    outcomes
}

async fn scalar(db: &Db, sql: &'static str) -> i64 {
    sqlx::query(sql)
        .fetch_one(db.pool())
        .await
        .unwrap()
        .get::<i64, _>(0)
}

#[tokio::test]
async fn a_batch_of_check_ins_fills_a_round_to_capacity_in_arrival_order() {
    let Some(db) = super::super::fresh_test_db().await else {
        return;
    };
    collecting_round(&db, 10).await;
    let outcomes = run_committed(
        &db,
        &[
            assign("a1", 3),
            assign("a2", 3),
            assign("a3", 3),
            assign("a4", 3),
        ],
    )
    .await;
    let granted = Some(SetOutcome::Assigned {
        key_id: Some("k1".into()),
    });
    assert_eq!(
        outcomes,
        [
            granted.clone(),
            granted.clone(),
            granted,
            Some(SetOutcome::NoSlot)
        ]
    );
    assert_eq!(
        scalar(&db, "SELECT live_assignments FROM rounds WHERE id = 'r1'").await,
        3
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT COUNT(*) FROM assignments WHERE state = 'ASSIGNED'"
        )
        .await,
        3
    );
    assert_eq!(
        scalar(&db, "SELECT COUNT(*) FROM state_history WHERE seq = 1").await,
        3
    );
}

#[tokio::test]
async fn uploads_apply_once_and_a_second_write_to_one_assignment_is_left_to_its_own_statement() {
    let Some(db) = super::super::fresh_test_db().await else {
        return;
    };
    collecting_round(&db, 10).await;
    run_committed(&db, &[assign("a1", 5), assign("a2", 5)]).await;
    let outcomes = run_committed(
        &db,
        &[upload("a1"), upload("a1"), upload("a2"), upload("nobody")],
    )
    .await;
    assert_eq!(
        outcomes,
        [
            Some(SetOutcome::Uploaded(true)),
            None,
            Some(SetOutcome::Uploaded(true)),
            Some(SetOutcome::Uploaded(false)),
        ]
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT COUNT(*) FROM assignments WHERE state = 'UPLOADED' \
             AND contribution_digest = 'blake3:' || id AND contribution_bytes = 100"
        )
        .await,
        2
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT MAX(seq) FROM state_history WHERE entity_id = 'a1'"
        )
        .await,
        2
    );
}

#[tokio::test]
async fn the_completion_that_reaches_the_goal_closes_the_round_once_and_later_ones_run_alone() {
    let Some(db) = super::super::fresh_test_db().await else {
        return;
    };
    collecting_round(&db, 2).await;
    run_committed(&db, &[assign("a1", 5), assign("a2", 5), assign("a3", 5)]).await;
    run_committed(&db, &[upload("a1"), upload("a2"), upload("a3")]).await;
    let outcomes = run_committed(
        &db,
        &[
            complete("a1"),
            complete("a1"),
            SetItem::Report { id: "a3".into() },
            complete("a2"),
            complete("a3"),
            complete("nobody"),
        ],
    )
    .await;
    assert_eq!(
        outcomes,
        [
            Some(SetOutcome::Completed { closed: false }),
            None,
            None,
            Some(SetOutcome::Completed { closed: true }),
            None,
            None,
        ]
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT completed_reports FROM rounds WHERE id = 'r1' AND state = 'AGGREGATING'"
        )
        .await,
        2
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT COUNT(*) FROM aggregation_jobs WHERE round_id = 'r1'"
        )
        .await,
        1
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT COUNT(*) FROM state_history WHERE entity_id = 'r1' AND to_state = 'AGGREGATING'"
        )
        .await,
        1
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT COUNT(*) FROM assignments WHERE state = 'COMPLETED'"
        )
        .await,
        2
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT MAX(seq) FROM state_history WHERE entity_id = 'a2'"
        )
        .await,
        3
    );
}

#[tokio::test]
async fn an_upload_and_a_completion_of_one_assignment_in_one_batch_apply_in_that_order() {
    let Some(db) = super::super::fresh_test_db().await else {
        return;
    };
    collecting_round(&db, 5).await;
    run_committed(&db, &[assign("a1", 5)]).await;
    let outcomes = run_committed(&db, &[complete("a1"), upload("a1")]).await;
    assert_eq!(
        outcomes,
        [
            Some(SetOutcome::Completed { closed: false }),
            Some(SetOutcome::Uploaded(true)),
        ]
    );
    assert_eq!(
        scalar(&db, "SELECT completed_reports FROM rounds WHERE id = 'r1'").await,
        1
    );
    let history: Vec<(i64, String)> = sqlx::query_as(
        "SELECT seq, to_state FROM state_history WHERE entity_id = 'a1' ORDER BY seq",
    )
    .fetch_all(db.pool())
    .await
    .unwrap();
    let expected = [(1, "ASSIGNED"), (2, "UPLOADED"), (3, "COMPLETED")]
        .map(|(seq, state)| (seq, state.to_string()));
    assert_eq!(history, expected);
}

/// Check-ins and completions of one round share one statement and one UPDATE of the round's
/// row: both counters move, and the completion that reaches the goal closes the round.
#[tokio::test]
async fn check_ins_and_completions_of_one_round_in_one_batch_move_both_counters() {
    let Some(db) = super::super::fresh_test_db().await else {
        return;
    };
    collecting_round(&db, 2).await;
    run_committed(&db, &[assign("a1", 5), assign("a2", 5)]).await;
    run_committed(&db, &[upload("a1"), upload("a2")]).await;
    let outcomes = run_committed(
        &db,
        &[
            assign("a3", 5),
            complete("a1"),
            assign("a4", 5),
            complete("a2"),
        ],
    )
    .await;
    let granted = Some(SetOutcome::Assigned {
        key_id: Some("k1".into()),
    });
    assert_eq!(
        outcomes,
        [
            granted.clone(),
            Some(SetOutcome::Completed { closed: false }),
            granted,
            Some(SetOutcome::Completed { closed: true }),
        ]
    );
    assert_eq!(
        scalar(&db, "SELECT live_assignments FROM rounds WHERE id = 'r1'").await,
        4
    );
    assert_eq!(
        scalar(&db, "SELECT completed_reports FROM rounds WHERE id = 'r1'").await,
        2
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT COUNT(*) FROM aggregation_jobs WHERE round_id = 'r1'"
        )
        .await,
        1
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT COUNT(*) FROM state_history WHERE entity_id IN ('a3', 'a4') AND seq = 1"
        )
        .await,
        2
    );
}

/// One round with only check-ins and another with only completions, in one batch: both sides of
/// the rounds' shared UPDATE (`delta`'s FULL JOIN) apply, each to its own round.
#[tokio::test]
async fn a_round_of_check_ins_and_a_round_of_completions_in_one_batch_each_move_their_own_counter()
{
    let Some(db) = super::super::fresh_test_db().await else {
        return;
    };
    collecting_round(&db, 5).await;
    run_committed(&db, &[assign("a1", 5)]).await;
    run_committed(&db, &[upload("a1")]).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO rounds (id, task_id, round_number, attempt, state, report_goal, \
         min_reports, deadline_at, opened_at, updated_at) \
         VALUES ('r2', 'task', 2, 1, 'COLLECTING', 5, 1, {NOW} + 60000, 0, 0)"
    )))
    .execute(db.pool())
    .await
    .unwrap();
    let mut check_in = assign("b1", 5);
    if let SetItem::Assign { new, .. } = &mut check_in {
        new.round_id = "r2".into();
    }
    let outcomes = run_committed(&db, &[complete("a1"), check_in]).await;
    assert_eq!(
        outcomes,
        [
            Some(SetOutcome::Completed { closed: false }),
            Some(SetOutcome::Assigned {
                key_id: Some("k1".into())
            }),
        ]
    );
    let counters: Vec<(String, i64, i64)> =
        sqlx::query_as("SELECT id, live_assignments, completed_reports FROM rounds ORDER BY id")
            .fetch_all(db.pool())
            .await
            .unwrap();
    assert_eq!(
        counters,
        [("r1".to_string(), 1, 1), ("r2".to_string(), 1, 0)]
    );
}
