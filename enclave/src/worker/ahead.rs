//! The open step's reads, started with the key request.
//!
//! Reading a contribution needs no key, and checking it against its committed digest needs only
//! the listing. Where the worker reads over the network (`confed-enclave` over the worker API),
//! the key is the job's longest wait before the open: a round trip or more to each key service,
//! run by other operators. So the reads the open step would make are started as the key is asked
//! for. What arrives before the key is held in memory, up to the job's read-ahead budget
//! (`Worker::read_ahead_bytes`, `confed-enclave --read-ahead-mib`), and the open step takes it in
//! turn with the same reads going on: no read is made twice, and none is cut off when the key
//! arrives. Nothing is opened early, and nothing read early is trusted early: each contribution
//! is checked against its committed digest as it is opened, as it always was.
//!
//! Over a store that reads on the calling thread (the embedded default's contribution log), or
//! with no budget, nothing is started: there the key services share the worker's cores, and reads
//! during the key took their CPU without shortening the round (performance.md, "Reading during
//! the key").

use std::future::Future;

use confed_worker_api::store::{JobSpec, JobStore, Partitioning, StoreError};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;

use super::open::{Reread, to_read};
use super::{JobError, Keyed, Phases, Worker};
use crate::aggregate::inputs::Input;
use crate::aggregate::partition;
use crate::envelope::RoundContext;

/// A contribution as read for the open step: its ref and committed digest with the bytes the
/// store served (`None`: missing), or the read's error.
pub(crate) type Read = Result<(Reread, Option<Vec<u8>>), StoreError>;

/// Reads of the contributions a job opens, started before its key.
pub(crate) struct Reads<'a> {
    /// What the reads are of (`fingerprint`): the open step checks they are the ones it would
    /// make.
    of: [u8; 32],
    /// What arrived while the key was fetched, in arrival order.
    held: Vec<Read>,
    /// The same reads, from where `held` stopped.
    rest: BoxStream<'a, Read>,
}

impl<'a> Reads<'a> {
    /// Started over `items` (each a ref with its digest, and its blob key) by `read`.
    fn new(
        items: Vec<(Reread, String)>,
        read: impl FnOnce(Vec<(Reread, String)>) -> BoxStream<'a, Read>,
    ) -> Self {
        Self {
            of: fingerprint(&items),
            held: Vec::new(),
            rest: read(items),
        }
    }

    /// Awaits `key` while holding what arrives, until the buffers held reach `budget` bytes (so
    /// at most the budget plus one contribution, besides the batches in flight), the reads end,
    /// or one fails (its error is then the last one held, for the open step to report).
    pub(super) async fn while_awaiting<F: Future>(&mut self, key: F, budget: usize) -> F::Output {
        let (held, rest) = (&mut self.held, &mut self.rest);
        let holding = async move {
            let mut bytes = 0usize;
            while bytes < budget {
                // The reads and the key share this task: yield to it whenever the runtime's
                // budget for this task runs out, however fast the reads arrive.
                tokio::task::consume_budget().await;
                let Some(read) = rest.next().await else { break };
                let failed = read.is_err();
                if let Ok((_, Some(buffer))) = &read {
                    bytes = bytes.saturating_add(buffer.capacity());
                }
                held.push(read);
                if failed {
                    break;
                }
            }
        };
        // `next` is cancel-safe (the stream keeps what is in flight), so a read under way when
        // the key arrives is not lost: the open step takes it from `rest`.
        let key = std::pin::pin!(key);
        let holding = std::pin::pin!(holding);
        match futures_util::future::select(key, holding).await {
            futures_util::future::Either::Left((keyed, _)) => keyed,
            futures_util::future::Either::Right(((), key)) => key.await,
        }
    }

    /// The reads as the open step takes them, those held in turn with those still arriving,
    /// if they are of exactly `to_read`.
    pub(super) fn into_stream(
        self,
        to_read: &[(Reread, String)],
    ) -> Result<BoxStream<'a, Read>, JobError> {
        if fingerprint(to_read) != self.of {
            return Err(JobError::ReadsNotTheOpens);
        }
        // In turn, not one after the other: the reads in flight go on arriving while those held
        // are opened (a chain would leave their connections unpolled until the last held one
        // was taken).
        let held = futures_util::stream::iter(self.held);
        Ok(futures_util::stream::select(held, self.rest).boxed())
    }

    #[cfg(test)]
    pub(super) fn held(&self) -> usize {
        self.held.len()
    }
}

/// BLAKE3 over every item's ref, committed digest and blob key, in order, each length-prefixed.
fn fingerprint(items: &[(Reread, String)]) -> [u8; 32] {
    let mut hasher = blake3::Hasher::new();
    for ((assignment_ref, digest), blob_key) in items {
        for field in [assignment_ref.as_bytes(), blob_key.as_bytes()] {
            hasher.update(&(field.len() as u64).to_le_bytes());
            hasher.update(field);
        }
        match digest {
            Some(digest) => hasher.update(&[1]).update(digest),
            None => hasher.update(&[0]),
        };
    }
    *hasher.finalize().as_bytes()
}

impl<S: JobStore + 'static> Worker<S> {
    /// The round's key against `inputs_digest` (`key_for`), with the open step's reads started
    /// with the request and what arrives before the key held (`start_reads`).
    pub(super) async fn key_reading(
        &self,
        job: &JobSpec,
        context: RoundContext,
        inputs_digest: String,
        inputs: &[Input],
        phases: &mut Phases,
    ) -> Result<(Keyed, Option<Reads<'_>>), JobError> {
        let mut reads = self.start_reads(job, inputs)?;
        let key = self.key_for(job, context, inputs_digest, phases);
        let keyed = match reads.as_mut() {
            Some(reads) => reads.while_awaiting(key, self.read_ahead_bytes).await,
            None => key.await,
        }?;
        Ok((keyed, reads))
    }

    /// Starts the reads of the contributions this job opens (the round's; a partition's range of
    /// `inputs`; none for a root, which merges sealed partitions), over a store that reads over
    /// the network. `None` over one that reads on the calling thread, or with no budget.
    fn start_reads(&self, job: &JobSpec, inputs: &[Input]) -> Result<Option<Reads<'_>>, JobError> {
        if self.read_ahead_bytes == 0 || self.store.blocking_fetch().is_some() {
            return Ok(None);
        }
        let opened = match &job.partitioning {
            Some(Partitioning::Root { .. }) => return Ok(None),
            Some(Partitioning::Partition { index, count }) => {
                partition::range(inputs.len(), *index, *count)?
            }
            None => 0..inputs.len(),
        };
        let items: Vec<(Reread, String)> = inputs[opened].iter().filter_map(to_read).collect();
        Ok(Some(Reads::new(items, |items| self.read_opened(items))))
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
    async fn reads_fill_to_the_budget_while_the_key_is_awaited_and_each_comes_once() {
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
    async fn a_key_that_arrives_while_the_reads_wait_loses_none_of_them() {
        let listed = items(4);
        let (sender, receiver) = tokio::sync::mpsc::unbounded_channel::<Read>();
        let arriving = futures_util::stream::unfold(receiver, |mut receiver| async move {
            receiver.recv().await.map(|read| (read, receiver))
        })
        .boxed();
        let mut reads = Reads::new(listed.clone(), |_| arriving);
        let served = |i: usize| Ok((listed[i].0.clone(), Some(vec![0u8; 1_000])));
        sender.send(served(0)).unwrap();
        sender.send(served(1)).unwrap();
        let (key_sender, key) = tokio::sync::oneshot::channel::<()>();
        let arrive_after_the_key = async {
            // The reads take the two sent and wait for more; then the key comes, and after it
            // the last two reads.
            tokio::task::yield_now().await;
            key_sender.send(()).unwrap();
            sender.send(served(2)).unwrap();
            sender.send(served(3)).unwrap();
        };
        let (keyed, ()) = tokio::join!(reads.while_awaiting(key, usize::MAX), arrive_after_the_key);
        keyed.unwrap();
        assert_eq!(reads.held(), 2);
        drop(sender);
        let mut all = refs_of(reads.into_stream(&listed).unwrap()).await;
        all.sort();
        let expected: Vec<Result<String, String>> =
            listed.iter().map(|((r, _), _)| Ok(r.clone())).collect();
        assert_eq!(all, expected);
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
        let fewer = items(2);
        assert!(matches!(
            reads.into_stream(&fewer),
            Err(JobError::ReadsNotTheOpens)
        ));
        let mut other_digest = listed.clone();
        other_digest[1].0.1 = Some([7; 32]);
        let reads = Reads::new(listed.clone(), |items| served(items, None));
        assert!(matches!(
            reads.into_stream(&other_digest),
            Err(JobError::ReadsNotTheOpens)
        ));
    }
}
