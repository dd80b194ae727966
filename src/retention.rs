//! Local retention, run by the scheduler role: every `period`, purge the contributions of rounds
//! closed longer than `window` ago (database rows in batches), then let the contribution store
//! delete what no row names any more (the contribution log's old segments). Without it, segments
//! and rows were never deleted (5.8 GB and 589 MB after ten minutes of load), which led straight
//! to a full disk. docs/operations.md, "Retention".

use std::sync::Arc;
use std::time::Duration;

use crate::blob::{BlobError, BlobStore};
use crate::clock::Clock;
use crate::db::{Db, DbError};

/// Rounds purged per database transaction.
const BATCH_ROUNDS: i64 = 16;

#[derive(Debug, thiserror::Error)]
pub enum RetentionError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Blob(#[from] BlobError),
}

#[derive(Debug, Clone)]
pub struct Retention {
    pub db: Db,
    /// The contribution store, when this process has it open (a scheduler-only process does
    /// not: its contributions are in GCS, which its lifecycle rule expires).
    pub contributions: Option<Arc<dyn BlobStore>>,
    pub clock: Arc<dyn Clock>,
    /// How long a closed round's contributions are kept.
    pub window: Duration,
    /// A storage unit written more recently than this is kept whatever the rows say (a durable
    /// record's row may be a moment from its commit).
    pub idle: Duration,
}

/// What one pass deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    pub rounds: usize,
    pub storage_units: usize,
}

impl Retention {
    pub async fn run_once(&self) -> Result<Purged, RetentionError> {
        let now = self.clock.now_millis();
        let before = now - self.window.as_millis() as i64;
        let mut purged = Purged::default();
        loop {
            let rounds = self
                .db
                .purge_closed_rounds(before, now, BATCH_ROUNDS)
                .await?
                .len();
            purged.rounds += rounds;
            if rounds < BATCH_ROUNDS as usize {
                break;
            }
        }
        if let Some(contributions) = &self.contributions {
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
