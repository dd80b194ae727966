//! The open step's reads, started with the key request.
//!
//! Reading a contribution needs no key, and checking it against its committed digest needs only
//! the listing. Where the worker reads over the network (the worker API, GCS), the key is the
//! job's longest wait before the open: a round trip or more to each key service, run by other
//! operators. So the reads the open step would make are started as the key is asked for. What
//! arrives before the key is held in memory, up to the job's budget (`Worker::retain_bytes`, less
//! what the first read kept), and the open step takes it first, then goes on with the same reads:
//! no read is made twice, and none is cut off when the key arrives. Nothing is opened early, and
//! nothing read early is trusted early: each contribution is checked against its committed digest
//! as it is opened, as it always was.
//!
//! Over a store that reads on the calling thread (the embedded default's local directory) nothing
//! is started: there the key services share the worker's cores, and reads during the key took
//! their CPU without shortening the round (performance.md, "Reading during the key").

use std::collections::VecDeque;
use std::future::Future;

use confed_worker_api::store::{JobSpec, JobStore, Partitioning, StoreError};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;

use super::open::{Reread, to_read};
use super::{JobError, Worker};
use crate::aggregate::inputs::Input;
use crate::aggregate::partition;

/// A contribution as read for the open step: its ref and committed digest with the bytes the
/// store served (`None`: missing), or the read's error.
pub(crate) type Read = Result<(Reread, Option<Vec<u8>>), StoreError>;

/// Reads of the contributions a job opens, started before its key.
pub(crate) struct Reads<'a> {
    /// The refs being read, in order: the open step checks they are the ones it would read.
    refs: Vec<String>,
    /// What arrived while the key was fetched, in arrival order.
    ahead: VecDeque<Read>,
    /// The same reads, from where `ahead` stopped.
    rest: BoxStream<'a, Read>,
}

impl<'a> Reads<'a> {
    /// Started over `items` (each a ref with its digest, and its blob key) by `read`.
    fn new(
        items: Vec<(Reread, String)>,
        read: impl FnOnce(Vec<(Reread, String)>) -> BoxStream<'a, Read>,
    ) -> Self {
        let refs = items.iter().map(|((r, _), _)| r.clone()).collect();
        Self {
            refs,
            ahead: VecDeque::new(),
            rest: read(items),
        }
    }

    /// Awaits `key` while reading into memory until `budget` bytes have arrived, the reads end,
    /// or one fails (its error is then the last item held, for the open step to report).
    pub(super) async fn while_awaiting<F: Future>(&mut self, key: F, budget: usize) -> F::Output {
        let (ahead, rest) = (&mut self.ahead, &mut self.rest);
        let filling = async move {
            let mut held = 0usize;
            while held < budget {
                let Some(read) = rest.next().await else { break };
                let failed = read.is_err();
                if let Ok((_, Some(bytes))) = &read {
                    held = held.saturating_add(bytes.len());
                }
                ahead.push_back(read);
                if failed {
                    break;
                }
            }
            std::future::pending::<()>().await
        };
        // The key first: once it is in, the reads go on in the open step. `next` is
        // cancel-safe, so a read in flight when the key arrives is not lost.
        let key = std::pin::pin!(key);
        let filling = std::pin::pin!(filling);
        match futures_util::future::select(key, filling).await {
            futures_util::future::Either::Left((keyed, _)) => keyed,
            futures_util::future::Either::Right(((), key)) => key.await,
        }
    }

    /// The reads as the open step takes them (those held, in turn with those still arriving), if
    /// they are of exactly `to_read`, in its order.
    pub(super) fn into_stream(
        self,
        to_read: &[(Reread, String)],
    ) -> Result<BoxStream<'a, Read>, JobError> {
        let same = self
            .refs
            .iter()
            .map(String::as_str)
            .eq(to_read.iter().map(|((r, _), _)| r.as_str()));
        if !same {
            return Err(JobError::ReadsNotTheOpens);
        }
        // Taken in turn, not one after the other: the reads in flight go on arriving while those
        // held are opened (a chain would leave them unpolled, their connections stalled, until the
        // last one held was taken).
        let held = futures_util::stream::iter(self.ahead);
        Ok(futures_util::stream::select(held, self.rest).boxed())
    }

    #[cfg(test)]
    pub(super) fn held(&self) -> usize {
        self.ahead.len()
    }
}

impl<S: JobStore + 'static> Worker<S> {
    /// Starts the reads of the contributions this job opens (the round's; a partition's range of
    /// `inputs`; none for a root, which merges sealed partitions), over a store that reads over
    /// the network. `None` over one that reads on the calling thread.
    pub(super) fn start_reads(
        &self,
        job: &JobSpec,
        inputs: &[Input],
    ) -> Result<Option<Reads<'_>>, JobError> {
        if self.store.blocking_fetch().is_some() {
            return Ok(None);
        }
        let opened = match &job.partitioning {
            Some(Partitioning::Root { .. }) => return Ok(None),
            Some(Partitioning::Partition { index, count }) => {
                partition::ranges(inputs.len(), *count)?
                    .get(*index as usize)
                    .cloned()
                    .ok_or_else(|| {
                        partition::PartitionError::Plan(format!("partition {index} of {count}"))
                    })?
            }
            None => 0..inputs.len(),
        };
        let items: Vec<(Reread, String)> = inputs[opened].iter().filter_map(to_read).collect();
        Ok(Some(Reads::new(items, |items| self.read_opened(items))))
    }

    /// What the open step may hold before it opens: the job's budget, less what the first read
    /// kept.
    pub(super) fn read_ahead_budget(&self, inputs: &[Input]) -> usize {
        let kept: usize = inputs
            .iter()
            .filter_map(|i| i.retained.as_ref())
            .map(Vec::len)
            .sum();
        self.retain_bytes.saturating_sub(kept)
    }
}

/// `key` awaited while `reads`, if any, fill up to `budget` bytes.
pub(super) async fn key_while_reading<F: Future>(
    key: F,
    reads: Option<&mut Reads<'_>>,
    budget: usize,
) -> F::Output {
    match reads {
        Some(reads) => reads.while_awaiting(key, budget).await,
        None => key.await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(count: usize) -> Vec<(Reread, String)> {
        (0..count)
            .map(|i| ((format!("{i:064x}"), None), format!("blob-{i}")))
            .collect()
    }

    /// Reads that serve each item as 1,000 bytes at once (never pending), or `fail_at`'s as an
    /// error.
    fn served(items: Vec<(Reread, String)>, fail_at: Option<usize>) -> BoxStream<'static, Read> {
        futures_util::stream::iter(items.into_iter().enumerate().map(move |(i, (reread, _))| {
            if Some(i) == fail_at {
                return Err(StoreError::Backend("the bucket is down".into()));
            }
            Ok((reread, Some(vec![0u8; 1_000])))
        }))
        .boxed()
    }

    async fn refs_of(stream: BoxStream<'_, Read>) -> Vec<Result<String, String>> {
        stream
            .map(|read| read.map(|((r, _), _)| r).map_err(|e| e.to_string()))
            .collect()
            .await
    }

    #[tokio::test]
    async fn reads_fill_to_the_budget_while_the_key_is_awaited_and_the_rest_follow_in_order() {
        let listed = items(10);
        let mut reads = Reads::new(listed.clone(), |items| served(items, None));
        // The key arrives only after the reads stopped at the budget (they never pend).
        let keyed = reads
            .while_awaiting(
                async {
                    tokio::task::yield_now().await;
                    "key"
                },
                3_000,
            )
            .await;
        assert_eq!(keyed, "key");
        assert_eq!(reads.held(), 3, "3,000 bytes of 1,000-byte reads");
        let mut all = refs_of(reads.into_stream(&listed).unwrap()).await;
        all.sort();
        let expected: Vec<Result<String, String>> =
            listed.iter().map(|((r, _), _)| Ok(r.clone())).collect();
        assert_eq!(
            all, expected,
            "each contribution once, none lost at the key"
        );
    }

    #[tokio::test]
    async fn a_key_already_in_holds_nothing_and_a_zero_budget_reads_nothing_ahead() {
        let listed = items(4);
        let mut reads = Reads::new(listed.clone(), |items| served(items, None));
        reads.while_awaiting(async {}, usize::MAX).await;
        assert_eq!(reads.held(), 0);
        let mut reads = Reads::new(listed.clone(), |items| served(items, None));
        reads.while_awaiting(tokio::task::yield_now(), 0).await;
        assert_eq!(reads.held(), 0);
        assert_eq!(refs_of(reads.into_stream(&listed).unwrap()).await.len(), 4);
    }

    #[tokio::test]
    async fn a_failed_read_ends_the_reading_ahead_and_is_reported_by_the_open() {
        let listed = items(5);
        let mut reads = Reads::new(listed.clone(), |items| served(items, Some(1)));
        reads
            .while_awaiting(tokio::task::yield_now(), usize::MAX)
            .await;
        assert_eq!(
            reads.held(),
            2,
            "the first read and the error, nothing after it"
        );
        let all = refs_of(reads.into_stream(&listed).unwrap()).await;
        let errors: Vec<&String> = all.iter().filter_map(|read| read.as_ref().err()).collect();
        assert_eq!(errors, ["store: the bucket is down"]);
    }

    #[tokio::test]
    async fn reads_of_other_contributions_than_the_open_step_names_are_refused() {
        let listed = items(3);
        let reads = Reads::new(listed.clone(), |items| served(items, None));
        let other = items(2);
        assert!(matches!(
            reads.into_stream(&other),
            Err(JobError::ReadsNotTheOpens)
        ));
    }
}
