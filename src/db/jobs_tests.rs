//! How the engines run a job's listing.

use super::*;

/// Each page of the listing is a range of `assignments_by_round` read in order: no sort, which
/// would be repeated for every page over all of the round's contributions after it.
#[tokio::test]
async fn the_listing_reads_its_pages_in_index_order_without_sorting() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open_sqlite(&dir.path().join("confed.db"))
        .await
        .unwrap();
    let plan = explain(&db).await;
    assert!(
        plan.iter().any(|step| step
            .contains("USING INDEX assignments_by_round (round_id=? AND state=? AND id>?)")),
        "{plan:?}"
    );
    assert!(
        !plan.iter().any(|step| step.contains("TEMP B-TREE")),
        "{plan:?}"
    );
}

/// `EXPLAIN QUERY PLAN`'s rows (id, parent, notused, detail): the details.
async fn explain(db: &Db) -> Vec<String> {
    use sqlx::Row as _;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "EXPLAIN QUERY PLAN {LISTING_SQLITE}"
    )))
    .bind("round")
    .bind("")
    .bind(LISTING_PAGE)
    .fetch_all(db.pool())
    .await
    .unwrap()
    .iter()
    .map(|row| row.get::<String, _>(3))
    .collect()
}
