//! Local retention, run by the scheduler role: every `period`, purge the contributions of rounds
//! closed longer than `window` ago (database rows in batches), then let the contribution store
//! delete what no row names any more (the contribution log's old segments). Without it, segments
//! and rows were never deleted (5.8 GB and 589 MB after ten minutes of load), which led straight
//! to a full disk. docs/operations.md, "Retention".

use std::sync::Arc;
use std::time::Duration;

use crate::blob::{BlobError, BlobStore};
use crate::db::{Db, DbError};

/// Assignments deleted per database transaction (a short hold of the SQLite writer).
const CHUNK_ROWS: i64 = 5_000;
/// The pause after each chunk of deletes (a pass of 1,000 rounds of 1,000 assignments takes
/// about 10 s longer).
const CHUNK_PAUSE: Duration = Duration::from_millis(50);
/// Rounds purged per pass at most; the next pass goes on.
const MAX_ROUNDS_PER_PASS: usize = 1_000;

#[derive(Debug, thiserror::Error)]
pub enum RetentionError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Blob(#[from] BlobError),
}

#[derive(Debug, Clone)]
pub struct Retention {
    db: Db,
    /// The contribution store, when this process has it open (a scheduler-only process does
    /// not: its contributions are in GCS, which its lifecycle rule expires).
    contributions: Option<Arc<dyn BlobStore>>,
    /// How long a closed round's contributions are kept.
    window: Duration,
    idle: Duration,
    /// Whether a pass ran before (the first one always checks the storage units).
    ran: Arc<std::sync::atomic::AtomicBool>,
}

/// What one pass deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    pub rounds: usize,
    pub storage_units: usize,
}

impl Retention {
    /// `contributions`: the contribution store when this process has it open; `window`: how
    /// long a closed round's contributions are kept; `idle`: a storage unit written more
    /// recently is kept whatever the rows say (a durable record's row may be a moment from its
    /// commit).
    pub fn new(
        db: Db,
        contributions: Option<Arc<dyn BlobStore>>,
        window: Duration,
        idle: Duration,
    ) -> Self {
        Self {
            db,
            contributions,
            window,
            idle,
            ran: Arc::default(),
        }
    }

    pub async fn run_once(&self) -> Result<Purged, RetentionError> {
        let now = self.db.now();
        let before = now.minus(self.window).0;
        let mut purged = Purged::default();
        while purged.rounds < MAX_ROUNDS_PER_PASS {
            let Some(round) = self.db.next_round_to_purge(before).await? else {
                break;
            };
            while self.db.purge_round_rows(&round, CHUNK_ROWS).await? >= CHUNK_ROWS as u64 {
                // Room for the WAL's checkpoint between chunks: deleting a backlog of rounds
                // without a pause grew SQLite's WAL to 0.9 GB for the length of a pass.
                tokio::time::sleep(CHUNK_PAUSE).await;
            }
            tokio::time::sleep(CHUNK_PAUSE).await;
            purged.rounds += 1;
        }
        // The segment step reads the oldest key in use (a scan of the assignments): only when
        // rows went, or on the first pass.
        let first = !self.ran.swap(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(contributions) = self
            .contributions
            .as_ref()
            .filter(|_| purged.rounds > 0 || first)
        {
            let oldest = self.db.oldest_log_key_in_use().await?;
            purged.storage_units = contributions
                .retire_unreferenced(oldest.as_deref(), self.idle)
                .await?;
        }
        if purged != Purged::default() {
            tracing::info!(
                rounds = purged.rounds,
                segments = purged.storage_units,
                "retention deleted the contributions of closed rounds"
            );
            metrics::counter!("confed_retention_rounds_purged_total")
                .increment(purged.rounds as u64);
        }
        Ok(purged)
    }

    /// Runs a pass every `period` until `stop` turns true.
    pub async fn run(self, period: Duration, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            if let Err(error) = self.run_once().await {
                tracing::warn!(%error, "retention pass failed; retrying next period");
            }
            tokio::select! {
                _ = tokio::time::sleep(period) => {}
                _ = stop.changed() => return,
            }
        }
    }
}
