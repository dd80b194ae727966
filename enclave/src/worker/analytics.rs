//! An analytics round's job (docs/analytics.md): the same inputs, commitment, key and signed
//! release as a training round's, with the analytics table in place of the sum and the result in
//! place of the average; no model update follows (the store completes the round when the release
//! is committed).

use std::sync::Arc;
use std::time::Instant;

use confed_protocol::analytics::AnalyticsQuery;
use confed_worker_api::store::{JobSpec, JobStore, StagedRelease};

use super::{JobError, JobOutcome, Keyed, Phases, Worker, signed_proof};
use crate::aggregate::Binding;
use crate::analytics::{AnalyticsAggregator, AnalyticsParams};
use crate::envelope::RoundContext;
use crate::policy::TaskPolicy;

impl<S: JobStore + 'static> Worker<S> {
    /// Runs an analytics round's job: read and digest the inputs, obtain the key against the
    /// commitment, open every answer into the table, noise and release once, commit.
    pub(super) async fn run_analytics_job(
        &self,
        job: &JobSpec,
        policy: &TaskPolicy,
        query: &AnalyticsQuery,
        context: RoundContext,
    ) -> Result<JobOutcome, JobError> {
        if job.partitioning.is_some() {
            return Err(JobError::MalformedJob(
                "analytics rounds are not partitioned by this release".into(),
            ));
        }
        if job.blt_state.is_some() || job.committed_average.is_some() {
            return Err(JobError::MalformedJob(
                "an analytics job names a BLT state or a committed average".into(),
            ));
        }
        let mut phases = Phases::default();
        let step = Instant::now();
        let params = AnalyticsParams::for_policy(policy)?
            .ok_or_else(|| JobError::MalformedJob("the policy names no query".into()))?;
        let (inputs, inputs_digest) = self.gather(job).await?;
        phases.read = step.elapsed();
        let Keyed {
            commitment,
            signing_key,
            receipts,
            private_key,
        } = self
            .key_for(job, &context, &inputs_digest, &mut phases)
            .await?;
        let step = Instant::now();
        let binding = Binding {
            context,
            key_id: job.key_id.clone(),
            inputs_digest,
        };
        let aggregator = Arc::new(
            AnalyticsAggregator::new(binding, query.clone(), &private_key)?
                .authenticating(policy.device_auth.clone()),
        );
        self.open_all(job, inputs, &aggregator).await?;
        let aggregator = Arc::try_unwrap(aggregator).map_err(|_| JobError::StillShared)?;
        phases.open = step.elapsed();
        let step = Instant::now();
        let release = tokio::task::spawn_blocking(move || aggregator.finish(&private_key, &params))
            .await
            .map_err(JobError::Thread)??;
        phases.noise = step.elapsed();
        let proof = signed_proof(&release.manifest, commitment, &signing_key, receipts);
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
}
