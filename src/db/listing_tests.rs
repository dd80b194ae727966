//! How the engines run a job's listing, and what a page must be for the next to be asked for.

use super::*;

/// Each page of the listing is a range of `assignments_completed_by_round` read in order: no
/// sort, which would be repeated for every page over all of the round's contributions after it.
#[tokio::test]
async fn sqlite_reads_the_listings_pages_in_index_order_without_sorting() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open_sqlite(&dir.path().join("confed.db"))
        .await
        .unwrap();
    let plan = explain(&db, "EXPLAIN QUERY PLAN", LISTING_SQLITE).await;
    let plan = plan.join("\n");
    assert!(
        plan.contains("USING INDEX assignments_completed_by_round (round_id=? AND id>?)"),
        "{plan}"
    );
    assert!(!plan.contains("TEMP B-TREE"), "{plan}");
}

/// PostgreSQL's generic plan (what a prepared statement settles on) for a round of 2,000
/// completed contributions among 20,000: an index scan of the listing's index, no sort.
#[tokio::test]
async fn postgresql_reads_the_listings_pages_in_index_order_without_sorting() {
    let Some(db) = crate::db::postgres::fresh_test_db().await else {
        return;
    };
    let mut conn = db.pool().acquire().await.unwrap();
    for statement in [
        // No task or round rows: the foreign keys' triggers off for this session.
        "SET session_replication_role = replica",
        "INSERT INTO assignments (id, round_id, state, expires_at, created_at, updated_at, \
         blob_key, contribution_blake3) SELECT md5(i::text) || md5((i + 1)::text), \
         'round-' || (i % 10), CASE WHEN i % 3 = 0 THEN 'ASSIGNED' ELSE 'COMPLETED' END, \
         0, 0, 0, 'blob/' || i, md5(i::text) || md5(i::text) FROM generate_series(1, 20000) i",
        "ANALYZE assignments",
        "SET plan_cache_mode = force_generic_plan",
    ] {
        sqlx::raw_sql(statement).execute(&mut *conn).await.unwrap();
    }
    let prepare = format!("PREPARE listing(text, text, bigint) AS {LISTING_POSTGRES}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(prepare))
        .execute(&mut *conn)
        .await
        .unwrap();
    let plan: Vec<String> = sqlx::query_scalar("EXPLAIN EXECUTE listing('round-1', '', 10000)")
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    let plan = plan.join("\n");
    assert!(
        plan.contains("Index Scan using assignments_completed_by_round"),
        "{plan}"
    );
    assert!(!plan.contains("Sort"), "{plan}");
}

/// `EXPLAIN QUERY PLAN`'s rows (id, parent, notused, detail) on SQLite: the details.
async fn explain(db: &Db, explain: &str, sql: &str) -> Vec<String> {
    use sqlx::Row as _;
    sqlx::query(sqlx::AssertSqlSafe(format!("{explain} {sql}")))
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

fn hex(n: u8) -> String {
    format!("{n:02x}").repeat(32)
}

fn page(refs: &[String]) -> Listed {
    refs.iter()
        .map(|id| (id.clone(), format!("blob/{id}"), None))
        .collect()
}

#[test]
fn a_full_page_goes_on_after_its_largest_ref_and_a_short_one_ends_the_listing() {
    let refs = [hex(1), hex(3), hex(2)];
    let full = page(&refs);
    assert_eq!(
        next_page("r", ("", 3), &full, Some(&hex(3)), 0).unwrap(),
        Some(hex(3))
    );
    let short = page(&refs[..2]);
    assert_eq!(
        next_page("r", (&hex(0), 3), &short, Some(&hex(3)), 3).unwrap(),
        None
    );
    assert_eq!(
        next_page("r", (&hex(9), 3), &Vec::new(), None, 6).unwrap(),
        None
    );
}

/// The database is not trusted: a page it makes up must not loop the lease or grow it without
/// bound, nor slip in a ref no device could hold.
#[test]
fn a_page_the_database_made_up_is_refused() {
    let refs = [hex(1), hex(2)];
    let cases: [(&str, Listed, Option<String>, usize, usize); 6] = [
        (
            "not a ref",
            page(&["Zed-1".to_string(), hex(2)]),
            Some(hex(2)),
            2,
            0,
        ),
        (
            "longer than asked",
            page(&[hex(1), hex(2), hex(3)]),
            Some(hex(3)),
            2,
            0,
        ),
        ("largest not its own", page(&refs), Some(hex(7)), 2, 0),
        ("largest missing", page(&refs), None, 2, 0),
        ("does not advance", page(&refs), Some(hex(2)), 2, 0),
        (
            "longer than a round",
            page(&refs),
            Some(hex(2)),
            2,
            MAX_LISTED - 1,
        ),
    ];
    for (case, listed, largest, asked, so_far) in cases {
        let after = if case == "does not advance" {
            hex(2)
        } else {
            String::new()
        };
        let checked = next_page("r", (&after, asked), &listed, largest.as_deref(), so_far);
        assert!(
            matches!(checked, Err(DbError::Corrupt(_))),
            "{case}: {checked:?}"
        );
    }
}
