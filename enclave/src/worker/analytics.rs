//! An analytics round's job (docs/analytics.md): the same inputs, commitment, key and signed
//! release as a training round's, with the analytics table in place of the sum and the result in
//! place of the average; no model update follows (the store completes the round when the release
//! is committed). A partitioned round's partitions seal their ranges' tables, and its root merges
//! them (`analytics::partition`) before it releases, as training's do.

use std::sync::Arc;
use std::time::Instant;

use confed_worker_api::store::{JobSpec, JobStore, Partitioning, StagedRelease};

use super::{
    JobError, JobOutcome, Keyed, Opening, Phases, Worker, check_plan, round_context, signed_proof,
};
use crate::analytics::{AnalyticsAggregator, AnalyticsParams, AnalyticsRelease};
use confed_attestation::release::ReleaseProof;

/// Where an analytics job's aggregation ends.
pub enum AnalyticsStep {
    /// A partition's job: its range's table, sealed for the root, of partition `plan.0` of
    /// `plan.1`.
    Sealed { sealed: Vec<u8>, plan: (u32, u32) },
    /// A whole round's or a root's job: the release and its signed proof, to commit.
    Released {
        release: Box<AnalyticsRelease>,
        proof: Box<ReleaseProof>,
    },
}

impl<S: JobStore + 'static> Worker<S> {
    /// Runs an analytics round's job (`aggregate_analytics`), then stores the sealed partition
    /// or commits the release.
    pub(super) async fn run_analytics_job(&self, job: &JobSpec) -> Result<JobOutcome, JobError> {
        let mut phases = Phases::default();
        let (release, proof) = match self.aggregate_analytics(job, &mut phases).await? {
            AnalyticsStep::Sealed { sealed, plan } => {
                return self.store_partition(job, &sealed, plan, phases).await;
            }
            AnalyticsStep::Released { release, proof } => (release, proof),
        };
        let step = Instant::now();
        self.store
            .commit_release(
                &job.job_id,
                &job.lease_holder,
                StagedRelease {
                    average: &release.result,
                    manifest: &release.manifest,
                    proof: &proof,
                    blt_state: None,
                },
            )
            .await?;
        phases.release = step.elapsed();
        let manifest = release.manifest;
        Ok(JobOutcome {
            task_id: job.task_id.clone(),
            round: job.round,
            included: manifest.included,
            excluded: manifest.excluded.values().sum(),
            epsilon_spent: Some(manifest.privacy.epsilon_spent),
            partition: None,
            phases,
        })
    }

    /// An analytics job up to what it commits: read and digest the inputs, obtain the key
    /// against the commitment, then open every answer into the table (a partition: only its
    /// range's, sealed; the root: every partition's sealed table merged), noise and release
    /// once. Records the time of each step in `phases`.
    pub async fn aggregate_analytics(
        &self,
        job: &JobSpec,
        phases: &mut Phases,
    ) -> Result<AnalyticsStep, JobError> {
        let (policy, context) = round_context(job)?;
        let query = policy
            .analytics
            .clone()
            .ok_or_else(|| JobError::MalformedJob("the policy names no query".into()))?;
        if job.blt_state.is_some() || job.committed_average.is_some() {
            return Err(JobError::MalformedJob(
                "an analytics job names a BLT state or a committed average".into(),
            ));
        }
        match &job.partitioning {
            Some(Partitioning::Partition { count, .. } | Partitioning::Root { count, .. }) => {
                check_plan(job.contributions.len(), *count)?
            }
            None => {}
        }
        let step = Instant::now();
        let params = AnalyticsParams::for_policy(&policy)?
            .ok_or_else(|| JobError::MalformedJob("the policy names no query".into()))?;
        let (inputs, inputs_digest) = self.gather(job).await?;
        phases.read = step.elapsed();
        let (
            Keyed {
                commitment,
                signing_key,
                receipts,
                private_key,
                binding,
            },
            reads,
        ) = self
            .key_reading(job, context, inputs_digest, &inputs, phases)
            .await?;
        let aggregator = Arc::new(
            AnalyticsAggregator::new(binding, query, &private_key)?
                .authenticating(policy.device_auth.clone()),
        );
        if let Some(Partitioning::Partition { index, count }) = job.partitioning {
            let plan = (index, count);
            let sealed = self
                .seal_range(
                    job,
                    Opening { inputs, reads },
                    plan,
                    private_key,
                    aggregator,
                    phases,
                )
                .await?;
            return Ok(AnalyticsStep::Sealed { sealed, plan });
        }
        let step = Instant::now();
        let aggregator = self
            .add_all(job, inputs, reads, &private_key, aggregator)
            .await?;
        phases.open = step.elapsed();
        let step = Instant::now();
        let release = tokio::task::spawn_blocking(move || aggregator.finish(&private_key, &params))
            .await
            .map_err(JobError::Thread)??;
        phases.noise = step.elapsed();
        let proof = signed_proof(&release.manifest, commitment, &signing_key, receipts);
        Ok(AnalyticsStep::Released {
            release: Box::new(release),
            proof: Box::new(proof),
        })
    }
}
