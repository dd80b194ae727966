//! A job's listing: its round's completed contributions (ref, blob key, BLAKE3), what every
//! lease of a round's job reads first. The database is not trusted with the listing's meaning
//! (the enclave checks every contribution against its committed digest), but it must not be able
//! to make the front end loop or grow without bound either: each page is checked.

use super::jobs::StoredContribution;
use super::{Db, DbError, Engine};
use crate::task_spec::{ADAPTIVE_OVER_SELECTION_CAP, MAX_OVER_SELECTION, MAX_REPORT_GOAL};

/// A page of a round's listing as one JSON array of `[ref, blob key, BLAKE3 hex or null]`,
/// built by the engine: one value through sqlx's Any driver instead of a row per contribution,
/// which cost about 8 us each (4-23 ms of a 1,000-contribution lease; performance.md); with it
/// the page's largest ref, where the next page starts. The contributions after ref `$2` in the
/// engine's order of refs, at most `$3`: a range of `assignments_completed_by_round`, read in
/// order with no sort (SQLite migration 0019, PostgreSQL 0015; before, every page sorted all of
/// the round's contributions after `$2`). The page itself comes in any order (it is sorted in
/// Rust), and its largest ref is the engine's, so pages follow the engine's collation whatever
/// it is.
const LISTING_SQLITE: &str = "SELECT json_group_array(json_array(id, blob_key, contribution_blake3)), \
     max(id) FROM (SELECT id, blob_key, contribution_blake3 FROM assignments \
     WHERE round_id = $1 AND state = 'COMPLETED' AND blob_key IS NOT NULL AND id > $2 \
     ORDER BY id LIMIT $3)";
const LISTING_POSTGRES: &str = "SELECT COALESCE(json_agg(json_build_array(id, blob_key, \
     contribution_blake3)), '[]')::text, max(id) FROM (SELECT id, blob_key, \
     contribution_blake3 FROM assignments WHERE round_id = $1 AND state = 'COMPLETED' \
     AND blob_key IS NOT NULL AND id > $2 ORDER BY id LIMIT $3) page";
/// Contributions a page of the listing holds: at about 370 bytes each (a 64-character ref, a
/// blob key of about 235, a digest of 64), about 4 MB a value, far under either engine's largest
/// (SQLite's 10^9 bytes, PostgreSQL's 1 GB) whatever the round's size.
const LISTING_PAGE: i64 = 10_000;
/// The most contributions a round can hold: its largest report goal over-selected as far as a
/// task may ask. A listing longer than this is the database's fault.
const MAX_LISTED: usize =
    (MAX_REPORT_GOAL as f64 * (1.0 + MAX_OVER_SELECTION.max(ADAPTIVE_OVER_SELECTION_CAP))) as usize;

/// One page as the engine sent it: `[ref, blob key, BLAKE3 hex or null]` each.
type Listed = Vec<(String, String, Option<String>)>;

impl Db {
    /// The round's completed contributions, sorted by ref (bytewise): what a job lists.
    pub async fn job_contributions(
        &self,
        round_id: &str,
    ) -> Result<Vec<StoredContribution>, DbError> {
        self.job_contributions_in_pages(round_id, LISTING_PAGE)
            .await
    }

    /// `job_contributions`, read `page` contributions at a time (tests use small pages).
    #[doc(hidden)]
    pub async fn job_contributions_in_pages(
        &self,
        round_id: &str,
        page: i64,
    ) -> Result<Vec<StoredContribution>, DbError> {
        let sql = match self.engine() {
            Engine::Sqlite => LISTING_SQLITE,
            Engine::Postgres => LISTING_POSTGRES,
        };
        let page = page.max(1);
        let mut conn = self.pool().acquire().await?;
        let mut rows: Listed = Vec::new();
        // Every ref sorts after the empty string, in any collation.
        let mut after = String::new();
        loop {
            let (listing, largest): (String, Option<String>) = sqlx::query_as(sql)
                .bind(round_id)
                .bind(&after)
                .bind(page)
                .fetch_one(&mut *conn)
                .await?;
            let listed: Listed = serde_json::from_str(&listing)
                .map_err(|e| DbError::Corrupt(format!("the listing of round {round_id}: {e}")))?;
            let asked = (after.as_str(), usize::try_from(page).unwrap_or(usize::MAX));
            let next = next_page(round_id, asked, &listed, largest.as_deref(), rows.len())?;
            rows.extend(listed);
            match next {
                Some(next) => after = next,
                None => break,
            }
        }
        // Bytewise, whatever the engine's collation.
        rows.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        Ok(rows
            .into_iter()
            .map(
                |(assignment_ref, blob_key, blake3_hex)| StoredContribution {
                    assignment_ref,
                    blob_key,
                    blake3_hex,
                },
            )
            .collect())
    }
}

/// Checks page `listed` of `round_id`'s listing, asked for after `after` (at most `page` refs,
/// `largest` of them by the engine's order), with `so_far` contributions listed before it, and
/// returns where the next page starts (`None`: this was the last). Every ref is a lowercase hex
/// SHA-256 (`Capability::reference`), the page no longer than asked, its largest ref one of its
/// own and not where it started (else the same page would be asked for again forever), and the
/// whole listing no longer than a round can be.
fn next_page(
    round_id: &str,
    (after, page): (&str, usize),
    listed: &Listed,
    largest: Option<&str>,
    so_far: usize,
) -> Result<Option<String>, DbError> {
    let corrupt = |why: String| {
        Err(DbError::Corrupt(format!(
            "the listing of round {round_id}: {why}"
        )))
    };
    if let Some((bad, _, _)) = listed
        .iter()
        .find(|(id, _, _)| !confed_protocol::hex::is_digest_hex(id))
    {
        return corrupt(format!("{bad:?} is not an assignment ref"));
    }
    if listed.len() > page {
        return corrupt(format!(
            "a page of {} when {page} were asked for",
            listed.len()
        ));
    }
    if so_far + listed.len() > MAX_LISTED {
        return corrupt(format!("more than {MAX_LISTED} contributions"));
    }
    if listed.len() < page {
        return Ok(None);
    }
    match largest {
        Some(largest) if largest != after && listed.iter().any(|(id, _, _)| id == largest) => {
            Ok(Some(largest.to_string()))
        }
        _ => corrupt(format!("a full page does not advance past {after:?}")),
    }
}

#[cfg(test)]
#[path = "listing_tests.rs"]
mod tests;
