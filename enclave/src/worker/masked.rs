//! A masked training round's job (docs/secure-aggregation.md): the same inputs, commitment and
//! key as a clear round's, then every contribution opened only into the masked sum
//! (`MaskedAggregator`); then the unmask, asked of the key services: each agrees to the
//! included set (one per round, a receipt each), and against `agreement(t, n)` receipts
//! returns its groups' mask sums; the enclave removes them, and the exact sum is noised,
//! averaged and released as any round's, its manifest recording the masking.
//!
//! A partitioned masked round: each partition seals its range's wrapping sum and its included
//! inputs' slots (`masked::partition`); the root merges them and runs the one unmask over the
//! whole included set, so the key services see one agreed set per round either way.

use std::sync::Arc;
use std::time::Instant;

use confed_attestation::release::ReleaseProof;
use confed_attestation::unmask::{UnmaskReceipt, agreement};
use confed_attestation::unmask_api::{AgreeRequest, MaskedInput, SumsRequest, UnmaskRound};
use confed_protocol::masking::{self, Layout, MaskSums};
use confed_worker_api::model::ModelSchema;
use confed_worker_api::store::{JobSpec, JobStore, Partitioning};

use super::{JobError, Keyed, KeyedRound, Opening, Phases, Worker, signed_proof};
use crate::aggregate::Release;
use crate::envelope::RoundContext;
use crate::key_collection::KeyServiceEndpoint;
use crate::masked::{BoundInput, MaskedAggregator};
use crate::policy::TaskPolicy;

impl<S: JobStore + 'static> Worker<S> {
    /// A masked round's aggregation up to its signed release (`Worker::aggregate` sends a masked
    /// policy's round here).
    pub(super) async fn aggregate_masked(
        &self,
        job: &JobSpec,
        schema: &ModelSchema,
        policy: &TaskPolicy,
        context: RoundContext,
        phases: &mut Phases,
    ) -> Result<(Release, ReleaseProof), JobError> {
        let masking = policy
            .masking
            .as_ref()
            .ok_or_else(|| JobError::MalformedJob("the policy does not mask".into()))?;
        if let Some(Partitioning::Root { count, .. }) = &job.partitioning {
            super::check_plan(job.contributions.len(), *count)?;
        }
        let KeyedRound {
            privacy,
            inputs,
            reads,
            keyed,
            continues,
        } = self.key_round(job, schema, context, policy, phases).await?;
        let Keyed {
            commitment,
            signing_key,
            receipts,
            private_key,
            binding,
        } = keyed;
        let step = Instant::now();
        let values = schema.parameter_count();
        let aggregator = MaskedAggregator::new(binding, masking.layout(), values, &private_key)?
            .authenticating(policy.device_auth.clone());
        // A partitioned round's root merges its partitions' sealed sums and slots instead.
        let aggregator = self
            .add_all(job, inputs, reads, &private_key, Arc::new(aggregator))
            .await?;
        phases.open = step.elapsed();

        let step = Instant::now();
        let included = aggregator.unmask_inputs();
        // Merged from partitions, the kept inputs must be exactly the included ones.
        if !included
            .iter()
            .map(|i| i.assignment_ref.as_str())
            .eq(aggregator.included().iter().map(String::as_str))
        {
            return Err(crate::aggregate::partition::PartitionError::Malformed(
                "the merged partitions' slots are not exactly the included contributions".into(),
            )
            .into());
        }
        if included.len() < policy.min_reports as usize {
            let (_, excluded) = aggregator.counts();
            return Err(crate::aggregate::AggregateError::TooFewIncluded {
                included: included.len() as u64,
                excluded: excluded as u64,
                min_reports: policy.min_reports,
            }
            .into());
        }
        aggregator.check_ring(included.len(), masking.noise_variance)?;
        let round = UnmaskRound {
            task_id: job.task_id.clone(),
            round: job.round,
            commitment_sha256: commitment.digest(),
            policy: job.policy.clone(),
        };
        let answers = self
            .mask_sums(
                &job.key_id,
                &round,
                masking.layout(),
                policy,
                (values, &included),
            )
            .await?;
        let schema = schema.clone();
        let unmasking = Arc::clone(&private_key);
        let clip_norm = privacy.clip_norm;
        let noise_variance = masking.noise_variance;
        let (aggregator, record) = tokio::task::spawn_blocking(move || {
            aggregator.unmask(&answers, clip_norm, noise_variance, schema, &unmasking)
        })
        .await
        .map_err(JobError::Thread)??;
        phases.unmask = step.elapsed();

        let step = Instant::now();
        let aggregator = aggregator.continuing(continues);
        let mut release = self
            .finish_renewing(job, aggregator, private_key, privacy)
            .await?;
        release.manifest.masking = Some(record);
        phases.noise = step.elapsed();
        let proof = signed_proof(&release.manifest, commitment, &signing_key, receipts);
        Ok((release, proof))
    }

    /// One partition of a masked round: the round's inputs, commitment and key as the whole
    /// round's, then only the partition's range opened into the wrapping sum, sealed with its
    /// outcomes and its included inputs' slots for the root (`masked::partition`).
    pub(super) async fn masked_partition(
        &self,
        job: &JobSpec,
        schema: &ModelSchema,
        policy: &TaskPolicy,
        context: RoundContext,
        (index, count): (u32, u32),
        phases: &mut Phases,
    ) -> Result<Vec<u8>, JobError> {
        let masking = policy
            .masking
            .as_ref()
            .ok_or_else(|| JobError::MalformedJob("the policy does not mask".into()))?;
        let KeyedRound {
            inputs,
            reads,
            keyed,
            ..
        } = self.key_round(job, schema, context, policy, phases).await?;
        let aggregator = MaskedAggregator::new(
            keyed.binding,
            masking.layout(),
            schema.parameter_count(),
            &keyed.private_key,
        )?
        .authenticating(policy.device_auth.clone());
        self.seal_range(
            job,
            Opening { inputs, reads },
            (index, count),
            keyed.private_key,
            Arc::new(aggregator),
            phases,
        )
        .await
    }

    /// The unmask: the included set agreed at every key service (concurrently), then, against
    /// the receipts, each agreeing service's mask sums. A key service that fails is left out:
    /// `MaskedAggregator::unmask` fails the round if a group is left without a sum.
    async fn mask_sums(
        &self,
        key_id: &str,
        round: &UnmaskRound,
        layout: Layout,
        policy: &TaskPolicy,
        (values, included): (usize, &[BoundInput]),
    ) -> Result<Vec<MaskSums>, JobError> {
        let masking = policy.masking.as_ref().expect("a masked policy");
        let numbered: Vec<(u8, &KeyServiceEndpoint)> = self
            .config
            .key_services
            .iter()
            .filter_map(|e| Some((masking.number_of(&e.id)?, e)))
            .collect();
        let agree = AgreeRequest {
            round: round.clone(),
            included: included.iter().map(|i| i.assignment_ref.clone()).collect(),
        };
        let agreed = futures_util::future::join_all(numbered.iter().map(|(_, endpoint)| {
            self.unmask_call::<UnmaskReceipt>((endpoint, key_id), "agree", &agree)
        }))
        .await;
        let mut receipts = Vec::new();
        let mut problems = Vec::new();
        for ((_, endpoint), answer) in numbered.iter().zip(agreed) {
            match answer {
                Ok(receipt) => receipts.push(receipt),
                Err(why) => problems.push(format!("{}: {why}", endpoint.id)),
            }
        }
        let needed = agreement(u16::from(layout.threshold()), u16::from(layout.services()));
        if receipts.len() < needed {
            return Err(JobError::Unmask(format!(
                "{} of {} key services agreed to the included set, {needed} must ({})",
                receipts.len(),
                layout.services(),
                problems.join("; ")
            )));
        }
        let items: Vec<Vec<&[u8]>> = included
            .iter()
            .map(|i| masking::split_seeds(&layout, &i.seeds))
            .collect::<Result<_, _>>()
            .map_err(|e| JobError::Unmask(format!("an included input's seeds: {e}")))?;
        let requests: Vec<(u8, &KeyServiceEndpoint, SumsRequest)> = numbered
            .iter()
            .map(|&(number, endpoint)| {
                let inputs = included
                    .iter()
                    .zip(&items)
                    .map(|(input, items)| {
                        MaskedInput::of_envelope(
                            &input.assignment_ref,
                            &input.enc,
                            &input.token,
                            items,
                            number,
                        )
                    })
                    .collect();
                let request = SumsRequest {
                    round: round.clone(),
                    values: values as u64,
                    receipts: receipts.clone(),
                    inputs,
                };
                (number, endpoint, request)
            })
            .collect();
        let answered =
            futures_util::future::join_all(requests.iter().map(|(number, endpoint, request)| {
                self.sums_of((*number, endpoint, key_id), request, &layout, values)
            }))
            .await;
        let mut answers = Vec::new();
        for ((_, endpoint, _), answer) in requests.iter().zip(answered) {
            match answer {
                Ok(sums) => answers.push(sums),
                Err(why) => {
                    tracing::warn!(keyservice = %endpoint.id, %why, "no mask sums from a key service")
                }
            }
        }
        Ok(answers)
    }

    /// One key service's mask sums, read from its `application/octet-stream` answer.
    async fn sums_of(
        &self,
        (number, endpoint, key_id): (u8, &KeyServiceEndpoint, &str),
        request: &SumsRequest,
        layout: &Layout,
        values: usize,
    ) -> Result<MaskSums, String> {
        let bytes = self
            .unmask_bytes((endpoint, key_id), "sums", request)
            .await?;
        let groups = layout.groups_of(number);
        let ring = layout.ring();
        let expected = groups.len() * values * ring.bytes();
        if bytes.len() != expected {
            return Err(format!(
                "{} bytes of mask sums, {expected} expected",
                bytes.len()
            ));
        }
        let sums = groups
            .into_iter()
            .zip(bytes.chunks_exact(values * ring.bytes()))
            .map(|(group, chunk)| (group, ring.values(chunk)))
            .collect();
        Ok(MaskSums {
            service: number,
            sums,
        })
    }

    async fn unmask_call<T: serde::de::DeserializeOwned>(
        &self,
        target: (&KeyServiceEndpoint, &str),
        route: &str,
        body: &impl serde::Serialize,
    ) -> Result<T, String> {
        let bytes = self.unmask_bytes(target, route, body).await?;
        serde_json::from_slice(&bytes).map_err(|e| format!("not the expected answer: {e}"))
    }

    /// POSTs `body` to key service `endpoint`'s unmask `route` for key `key_id`.
    async fn unmask_bytes(
        &self,
        (endpoint, key_id): (&KeyServiceEndpoint, &str),
        route: &str,
        body: &impl serde::Serialize,
    ) -> Result<Vec<u8>, String> {
        let url = format!(
            "{}/v1/keys/{key_id}/unmask/{route}",
            endpoint.url.trim_end_matches('/')
        );
        let response = self
            .http
            .post(&url)
            .timeout(
                self.config
                    .key_timeout
                    .max(std::time::Duration::from_secs(60)),
            )
            .json(body)
            .send()
            .await
            .map_err(|e| format!("unreachable: {e}"))?;
        let status = response.status();
        let bytes = response
            .bytes()
            .await
            .map_err(|e| format!("the answer broke off: {e}"))?;
        if !status.is_success() {
            return Err(format!(
                "{status}: {}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(400)])
            ));
        }
        Ok(bytes.to_vec())
    }
}
