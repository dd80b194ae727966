//! The open step of a job: every committed contribution read, checked against its digest
//! and opened into the aggregator, across all cores.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use confed_worker_api::reads::READ_AHEAD;
use confed_worker_api::store::{BlockingFetch, JobSpec, JobStore, StoreError};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;

use super::ahead::{Read, Reads};
use super::{JobError, Worker};
use crate::aggregate::inputs::Input;
use crate::aggregate::{Aggregator, Exclusion};
use crate::analytics::AnalyticsAggregator;

/// What the open step adds contributions to: a training round's sum or an analytics round's
/// table. Called from every core at once.
pub(crate) trait Opens: Send + Sync + 'static {
    fn add(&self, assignment_ref: &str, stored: Option<&[u8]>) -> Result<(), Exclusion>;
}

impl Opens for Aggregator {
    fn add(&self, assignment_ref: &str, stored: Option<&[u8]>) -> Result<(), Exclusion> {
        Aggregator::add(self, assignment_ref, stored)
    }
}

impl Opens for crate::masked::MaskedAggregator {
    fn add(&self, assignment_ref: &str, stored: Option<&[u8]>) -> Result<(), Exclusion> {
        crate::masked::MaskedAggregator::add(self, assignment_ref, stored)
    }
}

impl Opens for AnalyticsAggregator {
    fn add(&self, assignment_ref: &str, stored: Option<&[u8]>) -> Result<(), Exclusion> {
        AnalyticsAggregator::add(self, assignment_ref, stored)
    }
}

impl<S: JobStore + 'static> Worker<S> {
    /// Reads, checks and opens every input into `aggregator`. Over a store that reads on the
    /// calling thread, `open_on_cores`. Otherwise each contribution is opened as soon as it is
    /// read, one per core at a time, while the next are read (`READ_AHEAD`, in the store's
    /// batches: `JobStore::fetch_batch`): no batch boundary where a core waits for the slowest
    /// contribution of its batch, and at most `READ_AHEAD` + one per core contributions read and
    /// waiting (plus one being read per batch in flight) in memory, whatever the round's size,
    /// besides those held from before the key. `reads`: the same reads, started with the key
    /// request (`ahead`); those held are taken in turn with those still arriving. The lease is
    /// renewed before, every quarter lease during (on a timer, so also while a stalled read
    /// completes nothing), and after.
    pub(super) async fn open_all<A: Opens>(
        &self,
        job: &JobSpec,
        inputs: Vec<Input>,
        reads: Option<Reads<'_>>,
        aggregator: &Arc<A>,
    ) -> Result<(), JobError> {
        if let Some(fetch) = self.store.blocking_fetch() {
            return self.open_on_cores(job, inputs, aggregator, fetch).await;
        }
        let renew = || {
            self.store
                .renew(&job.job_id, &job.lease_holder, self.config.lease)
        };
        renew().await?;
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let opening = Arc::new(tokio::sync::Semaphore::new(cores));
        // Set at the first failure: opens already queued then add nothing more (the job fails,
        // and its aggregator is dropped unreleased; no need to keep its cores busy).
        let stopped = Arc::new(AtomicBool::new(false));
        // Those kept from the first read (or committed as missing) first, then the rest read in
        // the store's batches (`read_in_batches`), each checked against the digest the
        // commitment names for it (the store is not trusted to serve those bytes; `open_one`
        // checks them on all cores). Owned items: a stream over borrowed ones makes the job's
        // future not provably `Send`.
        let mut in_hand = Vec::new();
        let mut to_read = Vec::new();
        for input in inputs {
            match listed(input) {
                Listed::InHand(reread, bytes) => in_hand.push(Ok((reread, bytes))),
                Listed::ToRead(reread, blob_key) => to_read.push((reread, blob_key)),
            }
        }
        // The reads started with the key request (`ahead`), or started now.
        let read = match reads {
            Some(reads) => reads.into_stream(&to_read)?,
            None => self.read_opened(to_read),
        };
        // In turn, as with the reads held from before the key (`Reads::into_stream`): a chain
        // would leave the reads already started unpolled until every input in hand was taken.
        let opened = futures_util::stream::select(futures_util::stream::iter(in_hand), read)
            .map(|read| {
                let aggregator = Arc::clone(aggregator);
                let (opening, stopped) = (Arc::clone(&opening), Arc::clone(&stopped));
                async move {
                    let (reread, stored) = read?;
                    // Never closed: an error would only mean opening without waiting.
                    let _core = opening.acquire().await.ok();
                    tokio::task::spawn_blocking(move || {
                        if stopped.load(Ordering::Relaxed) {
                            return Ok(None);
                        }
                        open_one(&*aggregator, reread, stored)
                    })
                    .await
                    .map_err(JobError::Thread)?
                    .map_err(|changed| JobError::from(not_committed(&changed)))
                }
            })
            .buffer_unordered(READ_AHEAD + cores);
        let mut opened = std::pin::pin!(opened);
        // The runtime's clock, as the timeout below keeps it.
        let mut renewed = tokio::time::Instant::now();
        loop {
            // Renewed on time even while nothing completes (a store that stalls mid-batch):
            // a lease lost meanwhile stops the job at the next renewal.
            let wait = (self.config.lease / 4).saturating_sub(renewed.elapsed());
            let next = tokio::time::timeout(wait, opened.next()).await;
            if renewed.elapsed() >= self.config.lease / 4 {
                if let Err(error) = renew().await {
                    stopped.store(true, Ordering::Relaxed);
                    return Err(error.into());
                }
                renewed = tokio::time::Instant::now();
            }
            match next {
                Err(_) | Ok(Some(Ok(None))) => {}
                Ok(None) => break,
                Ok(Some(Ok(Some(buffer)))) => self.buffers.give(buffer),
                Ok(Some(Err(error))) => {
                    stopped.store(true, Ordering::Relaxed);
                    return Err(error);
                }
            }
        }
        renew().await?;
        Ok(())
    }

    /// The store's reads of `items` (each a ref with its committed digest, and its blob key),
    /// in its batches, each paired with its item; a contribution the store does not have is an
    /// error (it was committed).
    pub(super) fn read_opened(&self, items: Vec<(Reread, String)>) -> BoxStream<'_, Read> {
        self.read_in_batches(items, |reread| not_committed(&reread.0))
            .map(|read| read.and_then(|(reread, stored)| served(reread, stored)))
            .boxed()
    }

    /// `open_all` over a store that reads on the calling thread: one blocking task per core
    /// takes the next input, reads it into that task's own buffer, checks it and opens it, with
    /// no hand-off between the steps (a read and an open each handed to the blocking pool left
    /// the cores idle a fifth of the time, and switching tasks took another tenth). One
    /// contribution per core in memory. The lease is renewed before, every quarter lease during,
    /// and after.
    async fn open_on_cores<A: Opens>(
        &self,
        job: &JobSpec,
        inputs: Vec<Input>,
        aggregator: &Arc<A>,
        fetch: Arc<dyn BlockingFetch>,
    ) -> Result<(), JobError> {
        let renew = || {
            self.store
                .renew(&job.job_id, &job.lease_holder, self.config.lease)
        };
        renew().await?;
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let queue = Arc::new(std::sync::Mutex::new(inputs.into_iter()));
        // Set at the first failure, or when this future is dropped (a worker shutting down):
        // the cores stop after the contribution in hand instead of opening the rest of the
        // round for nobody.
        // (Dropped, it leaves the cores' tasks to end on their own; they hold the aggregator
        // until then, and nothing is released from it.)
        let stopped = Arc::new(AtomicBool::new(false));
        let _stop_when_dropped = StopOnExit::new(Arc::clone(&stopped));
        let tasks = (0..cores).map(|_| {
            let (queue, stopped) = (Arc::clone(&queue), Arc::clone(&stopped));
            let (fetch, aggregator) = (Arc::clone(&fetch), Arc::clone(aggregator));
            tokio::task::spawn_blocking(move || {
                // Stops the other cores unless this one ends well: an error, or a panic.
                let stop = StopOnExit::new(Arc::clone(&stopped));
                let outcome = open_queue(&queue, &stopped, &*fetch, &*aggregator);
                if outcome.is_ok() {
                    stop.disarm();
                }
                outcome
            })
        });
        let mut opening = std::pin::pin!(futures_util::future::join_all(tasks));
        let finished = loop {
            match tokio::time::timeout(self.config.lease / 4, &mut opening).await {
                Ok(finished) => break finished,
                Err(_) => {
                    if let Err(error) = renew().await {
                        stopped.store(true, Ordering::Relaxed);
                        return Err(error.into());
                    }
                }
            }
        };
        for task in finished {
            task.map_err(JobError::Thread)??;
        }
        renew().await?;
        Ok(())
    }
}

/// Sets its flag when dropped, unless disarmed.
struct StopOnExit(Option<Arc<AtomicBool>>);

impl StopOnExit {
    fn new(flag: Arc<AtomicBool>) -> Self {
        Self(Some(flag))
    }

    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for StopOnExit {
    fn drop(&mut self) {
        if let Some(flag) = &self.0 {
            flag.store(true, Ordering::Relaxed);
        }
    }
}

/// An input as the open step finds it: its bytes already in hand (kept from the first read, or
/// none to read: a contribution listed without a digest that the store did not have), or to be
/// read from `blob_key` and checked against its committed digest.
enum Listed {
    InHand(Reread, Option<Vec<u8>>),
    ToRead(Reread, String),
}

/// An input the open step reads from the store: its ref and committed digest, and its blob
/// key. `None` for one in hand (kept from the first read, or listed without a digest and not
/// stored).
pub(super) fn to_read(input: &Input) -> Option<(Reread, String)> {
    match (&input.retained, input.digest) {
        (None, Some(expected)) => Some((
            (input.assignment_ref.clone(), Some(expected)),
            input.blob_key.clone(),
        )),
        _ => None,
    }
}

fn listed(input: Input) -> Listed {
    if let Some((reread, blob_key)) = to_read(&input) {
        return Listed::ToRead(reread, blob_key);
    }
    // Kept from the first read (this job digested those bytes itself), or listed without a
    // digest and not stored.
    Listed::InHand((input.assignment_ref, None), input.retained)
}

/// What the store served for a committed contribution: missing fails the job.
fn served(
    reread: Reread,
    stored: Option<Vec<u8>>,
) -> Result<(Reread, Option<Vec<u8>>), StoreError> {
    if stored.is_none() {
        return Err(not_committed(&reread.0));
    }
    Ok((reread, stored))
}

/// One core's share of `open_on_cores`: the next input from `queue` until it is empty or
/// another core failed, each read into this core's buffer, checked and opened.
fn open_queue<A: Opens>(
    queue: &std::sync::Mutex<std::vec::IntoIter<Input>>,
    stopped: &AtomicBool,
    fetch: &dyn BlockingFetch,
    aggregator: &A,
) -> Result<(), JobError> {
    let mut buffer = Vec::new();
    while !stopped.load(Ordering::Relaxed) {
        let next = queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .next();
        let Some(input) = next else {
            return Ok(());
        };
        let (reread, stored) = match listed(input) {
            Listed::InHand(reread, bytes) => (reread, bytes),
            Listed::ToRead(reread, blob_key) => served(
                reread,
                fetch.fetch_into(&blob_key, std::mem::take(&mut buffer))?,
            )?,
        };
        match open_one(aggregator, reread, stored) {
            Ok(Some(back)) => buffer = back,
            Ok(None) => {}
            Err(changed) => return Err(not_committed(&changed).into()),
        }
    }
    Ok(())
}

/// A contribution the store did not serve as committed: missing, or with another digest. The
/// job fails (it is not excluded): a release without it would differ from the committed one by
/// that device's update under the same noise.
fn not_committed(assignment_ref: &str) -> StoreError {
    StoreError::Conflict(format!(
        "contribution {assignment_ref} is not the bytes the round's commitment names \
         (missing or changed in the store since they were digested)"
    ))
}

/// A contribution to open: its ref, and the digest its bytes must have (`None` when they are the
/// ones this job read and digested itself).
pub(super) type Reread = (String, Option<[u8; 32]>);

/// Checks a contribution against its committed digest and adds it (the check just before it is
/// opened, while its bytes are in this core's cache); gives back its buffer, or its ref when it
/// is not as committed. The job then fails, and what was added before is dropped with the
/// aggregator, unreleased.
fn open_one<A: Opens>(
    aggregator: &A,
    (assignment_ref, expected): Reread,
    stored: Option<Vec<u8>>,
) -> Result<Option<Vec<u8>>, String> {
    if let Some(expected) = expected
        && stored
            .as_deref()
            .is_none_or(|bytes| *blake3::hash(bytes).as_bytes() != expected)
    {
        return Err(assignment_ref);
    }
    let _ = aggregator.add(&assignment_ref, stored.as_deref());
    Ok(stored)
}
