//! Round closes announced across replicas. A process that closes a round on PostgreSQL wakes its
//! own worker and long-polling leases at once (`Db::job_created`), and also sends `NOTIFY
//! confed_jobs` after the commit; every process listens on that channel and raises the same local
//! signal, so a round closed by one replica is leased by a worker waiting on another within a
//! round trip, not at its next poll. Notifications are a hint, never the truth: a worker still
//! leases through the guarded job query, a lost notification (the listening connection dropped)
//! costs one poll interval, and a reconnect raises the signal once in case one was missed.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio::sync::Notify;

/// The channel; the payload is empty (the listener only needs to know to look).
pub(crate) const CHANNEL: &str = "confed_jobs";

/// `NOTIFY` as a statement that takes the channel as a parameter.
pub(crate) const ANNOUNCE_SQL: &str = "SELECT pg_notify($1, '')";

/// The listening task; aborted when the last handle of its `Db` is dropped.
#[derive(Debug)]
pub(crate) struct Listener(tokio::task::JoinHandle<()>);

impl Drop for Listener {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Connects a listener to `url` and subscribes it before returning (so a close committed after
/// this returns is seen), then raises `signal` for every notification. `None` (logged) where the
/// database cannot LISTEN (a pooler in transaction mode, or an engine with only the PostgreSQL
/// wire protocol): the notification is a hint, and workers then find jobs at their next poll.
pub(crate) async fn listen(url: &str, signal: Arc<Notify>) -> Option<Listener> {
    let subscribed = async {
        let mut listener = PgListener::connect(url).await?;
        listener.listen(CHANNEL).await?;
        Ok::<_, sqlx::Error>(listener)
    };
    let mut listener = match subscribed.await {
        Ok(listener) => listener,
        Err(error) => {
            tracing::warn!(%error, "cannot LISTEN for new aggregation jobs; workers on other replicas find them at their next poll");
            return None;
        }
    };
    Some(Listener(tokio::spawn(async move {
        loop {
            match listener.try_recv().await {
                Ok(Some(_)) => signal.notify_one(),
                // The connection dropped and has been re-established and subscribed again
                // (sqlx reconnects eagerly): something may have been missed meanwhile, so look.
                Ok(None) => signal.notify_one(),
                Err(error) => {
                    tracing::warn!(%error, "the job notification listener cannot reconnect; workers fall back to polling until it can");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    // A notification sent while it was down is lost: look once per attempt.
                    signal.notify_one();
                }
            }
        }
    })))
}
