//! The first read of a job's inputs: the digests its release commitment names (listed by the
//! store, or read and digested here on all cores).

use confed_worker_api::reads::next_batch;
use confed_worker_api::store::{JobSpec, JobStore, StoreError};

use super::{JobError, Worker};
use crate::aggregate::inputs::{self, Input};

impl<S: JobStore + 'static> Worker<S> {
    /// The inputs the round's commitment names: a contribution the job lists with a digest is
    /// not read here (it is read once, after the key, and must have that digest); one without is
    /// read and digested in batches on all cores (one batch while the next is read), kept in
    /// memory up to `retain_bytes` in all (the rest is read again after the key arrives).
    pub(super) async fn gather(&self, job: &JobSpec) -> Result<(Vec<Input>, String), JobError> {
        let mut inputs: Vec<Input> = job
            .contributions
            .iter()
            .map(|listed| Input {
                assignment_ref: listed.assignment_ref.clone(),
                blob_key: listed.blob_key.clone(),
                digest: listed.blake3,
                retained: None,
            })
            .collect();
        // Owned items: a stream over borrowed ones makes the job's future not provably `Send`.
        let keys: Vec<(usize, String)> = inputs
            .iter()
            .enumerate()
            .filter(|(_, input)| input.digest.is_none())
            .map(|(index, input)| (index, input.blob_key.clone()))
            .collect();
        // In the store's batches (one request for several over the worker API).
        let reads = self.read_in_batches(keys, |_| {
            StoreError::Backend(
                "the store served fewer contributions than a batch of reads named".into(),
            )
        });
        let mut reads = std::pin::pin!(reads);
        let mut retained = 0usize;
        type Digested = Vec<(usize, Option<Vec<u8>>, Option<[u8; 32]>)>;
        let mut digesting: Option<tokio::task::JoinHandle<Digested>> = None;
        loop {
            let batch = next_batch(&mut reads, self.config.batch, self.config.batch_bytes).await?;
            if let Some(previous) = digesting.take() {
                for (index, bytes, digest) in previous.await.map_err(JobError::Thread)? {
                    let input = &mut inputs[index];
                    input.digest = digest;
                    match bytes {
                        Some(bytes) if retained + bytes.len() <= self.retain_bytes => {
                            retained += bytes.len();
                            input.retained = Some(bytes);
                        }
                        Some(bytes) => self.buffers.give(bytes),
                        None => {}
                    }
                }
                self.store
                    .renew(&job.job_id, &job.lease_holder, self.config.lease)
                    .await?;
            }
            if batch.is_empty() {
                break;
            }
            digesting = Some(tokio::task::spawn_blocking(move || {
                let (indices, stored): (Vec<usize>, Vec<Option<Vec<u8>>>) =
                    batch.into_iter().unzip();
                let digests = inputs::digest_all(&stored);
                indices
                    .into_iter()
                    .zip(stored)
                    .zip(digests)
                    .map(|((index, bytes), digest)| (index, bytes, digest))
                    .collect()
            }));
        }
        let digest = inputs::sort_and_digest(&mut inputs).map_err(JobError::MalformedJob)?;
        Ok((inputs, digest))
    }
}
