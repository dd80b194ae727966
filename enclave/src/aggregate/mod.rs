//! Aggregation inside the enclave: open each contribution, check it, clip it, add it to an exact
//! integer sum (in parallel, streaming: a contribution's plaintext lives only while it is added),
//! then noise the sum once and release the average with a manifest. The un-noised sum never
//! leaves this module: `finish` consumes it.

pub mod accumulator;
pub mod contribution;
pub mod inputs;
pub mod manifest;
pub mod noise;
pub mod stream;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;
use sha2::{Digest, Sha256};
use thiserror::Error;
use zeroize::Zeroizing;

use crate::dp::{self, DiscreteGaussian, DpError, grid};
use crate::envelope::EnvelopeRef;
use crate::hpke::PrivateKey;
use crate::hpke_awslc::Recipient;
use crate::model::{ModelError, ModelSchema, encode_f32_tensors};
use crate::policy::Mechanism;
use crate::policy::TaskPolicy;
use accumulator::{Accumulator, StreamError};
pub(crate) use confed_protocol::hex::encode as hex;
pub use contribution::{Binding, Exclusion};
pub use manifest::{Manifest, NoiseRecord, PrivacyRecord, TreeRecord, TreeShape};
use stream::StreamProblem;

/// Models of at least this many bytes of values are aggregated chunk by chunk: a thread then
/// holds one chunk of plaintext (1 MiB) instead of a whole update.
pub const STREAM_ABOVE_BYTES: usize = 8 << 20;

/// Excluded refs listed one by one in the manifest, at most (counts are always complete).
const LISTED_EXCLUSIONS: usize = 1000;

#[derive(Debug, Error)]
pub enum AggregateError {
    #[error("no contribution of the round was valid ({0} excluded); nothing to release")]
    NothingIncluded(u64),
    #[error(
        "only {included} valid contributions ({excluded} excluded), fewer than the policy's min_reports {min_reports}; nothing to release"
    )]
    TooFewIncluded {
        included: u64,
        excluded: u64,
        min_reports: u32,
    },
    #[error("cannot load the round's key into the HPKE receiver: {0}")]
    Key(String),
    #[error(transparent)]
    Dp(#[from] DpError),
    #[error("cannot encode the aggregate: {0}")]
    Encode(#[from] ModelError),
}

/// The privacy parameters of the task, as the enclave applies them: taken from the task policy
/// the contributions are bound to, never from anywhere else.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrivacyParams {
    pub epsilon: f64,
    pub delta: f64,
    pub clip_norm: f64,
    pub rounds: u32,
    /// Fewest included contributions a release may average.
    pub min_reports: u32,
    pub mechanism: Mechanism,
}

impl TryFrom<&TaskPolicy> for PrivacyParams {
    type Error = crate::policy::PolicyError;

    fn try_from(policy: &TaskPolicy) -> Result<Self, Self::Error> {
        Ok(Self {
            epsilon: policy.epsilon,
            delta: policy.delta,
            clip_norm: policy.clip_norm,
            rounds: policy.rounds,
            min_reports: policy.min_reports,
            mechanism: policy.mechanism()?,
        })
    }
}

pub struct Aggregator {
    binding: Binding,
    clip_norm: f64,
    schema: ModelSchema,
    recipient: Recipient,
    sum: Accumulator,
    outcome: Mutex<Outcome>,
    next_start: AtomicUsize,
    buffers: Mutex<Vec<Zeroizing<Vec<u8>>>>,
    /// Updates of at least this many bytes of values are streamed (`stream.rs`).
    stream_above: usize,
}

#[derive(Default)]
struct Outcome {
    included: Vec<String>,
    excluded: Vec<(String, Exclusion)>,
}

/// The noised, averaged result of a round: what may leave the enclave.
pub struct Release {
    /// The noised average update, safetensors with the model's tensors.
    pub average: Vec<u8>,
    pub manifest: Manifest,
    /// The average as f32 values in schema order (for the model updater).
    pub values: Vec<f32>,
}

impl Aggregator {
    pub fn new(
        binding: Binding,
        clip_norm: f64,
        schema: ModelSchema,
        private_key: &PrivateKey,
    ) -> Result<Self, AggregateError> {
        let recipient =
            Recipient::new(private_key).map_err(|e| AggregateError::Key(e.to_string()))?;
        let sum = Accumulator::new(schema.parameter_count());
        Ok(Self {
            binding,
            clip_norm,
            schema,
            recipient,
            sum,
            outcome: Mutex::default(),
            next_start: AtomicUsize::new(0),
            buffers: Mutex::default(),
            stream_above: STREAM_ABOVE_BYTES,
        })
    }

    /// Streams updates of at least `bytes` bytes of values (tests use small values).
    pub fn stream_above(mut self, bytes: usize) -> Self {
        self.stream_above = bytes;
        self
    }

    /// Adds one stored contribution (`None`: its bytes were missing). Safe to call from many
    /// threads at once.
    pub fn add(&self, assignment_ref: &str, stored: Option<&[u8]>) -> Result<(), Exclusion> {
        let result = self.try_add(assignment_ref, stored);
        let mut outcome = self.outcome.lock().expect("aggregation outcome");
        match result {
            Ok(()) => outcome.included.push(assignment_ref.to_string()),
            Err(reason) => outcome.excluded.push((assignment_ref.to_string(), reason)),
        }
        result
    }

    fn try_add(&self, assignment_ref: &str, stored: Option<&[u8]>) -> Result<(), Exclusion> {
        let stored = stored.ok_or(Exclusion::Missing)?;
        // A plaintext buffer from the pool: reused across contributions (no allocation and page
        // faults per contribution), wiped when the aggregator is dropped.
        let mut plaintext = self
            .buffers
            .lock()
            .expect("plaintext buffers")
            .pop()
            .unwrap_or_default();
        let outcome = self.add_plaintext(assignment_ref, stored, &mut plaintext);
        self.buffers
            .lock()
            .expect("plaintext buffers")
            .push(plaintext);
        outcome
    }

    fn add_plaintext(
        &self,
        assignment_ref: &str,
        stored: &[u8],
        plaintext: &mut Vec<u8>,
    ) -> Result<(), Exclusion> {
        // Large chunked updates go straight from each decrypted chunk into the sum.
        if self.schema.parameter_count() * 4 >= self.stream_above {
            let envelope = EnvelopeRef::parse(stored).map_err(|_| Exclusion::MalformedEnvelope)?;
            if envelope.key_id != self.binding.key_id {
                return Err(Exclusion::WrongKey);
            }
            if let Some(update) = stream::ChunkedUpdate::new(
                &self.recipient,
                envelope,
                &self.binding.context,
                assignment_ref,
                &self.schema,
            ) {
                match self.sum.add_clipped_stream(&update, self.clip_norm) {
                    Ok(()) => return Ok(()),
                    Err(StreamError::NonFinite) => return Err(Exclusion::NonFinite),
                    Err(StreamError::Source(StreamProblem::Excluded(why))) => return Err(why),
                    Err(StreamError::Source(StreamProblem::Buffer)) => {}
                }
            }
        }
        contribution::open(
            &self.recipient,
            &self.binding,
            assignment_ref,
            stored,
            plaintext,
        )?;
        let tensors = contribution::tensors(&self.schema, plaintext)?;
        let start = self.next_start.fetch_add(1, Ordering::Relaxed);
        self.sum
            .add_clipped(&tensors, self.clip_norm, start)
            .map_err(|accumulator::NonFinite| Exclusion::NonFinite)
    }

    /// Adds a batch across all cores.
    pub fn add_batch(&self, batch: &[(String, Option<Vec<u8>>)]) {
        batch.par_iter().for_each(|(assignment_ref, stored)| {
            let _ = self.add(assignment_ref, stored.as_deref());
        });
    }

    /// Contributions included and excluded so far.
    pub fn counts(&self) -> (usize, usize) {
        let outcome = self.outcome.lock().expect("aggregation outcome");
        (outcome.included.len(), outcome.excluded.len())
    }

    /// Noises the sum once and releases the average. The noise is keyed from `private_key` and
    /// everything the release depends on (see `noise`; the caller states the inputs' digest in
    /// the binding and must add exactly those inputs), so the same inputs give the same bytes and
    /// any other inputs give independent noise.
    pub fn finish(
        self,
        private_key: &PrivateKey,
        privacy: PrivacyParams,
    ) -> Result<Release, AggregateError> {
        let mut outcome = self.outcome.into_inner().expect("aggregation outcome");
        outcome.included.sort();
        outcome.excluded.sort();
        let count = outcome.included.len() as u64;
        if count == 0 {
            return Err(AggregateError::NothingIncluded(
                outcome.excluded.len() as u64
            ));
        }
        if count < u64::from(privacy.min_reports) {
            return Err(AggregateError::TooFewIncluded {
                included: count,
                excluded: outcome.excluded.len() as u64,
                min_reports: privacy.min_reports,
            });
        }
        let included_digest = digest(&outcome.included);
        let inputs_digest = self.binding.inputs_digest.clone();
        let calibration = dp::calibrate_mechanism(
            privacy.mechanism,
            privacy.epsilon,
            privacy.delta,
            privacy.rounds,
        )?;
        let noise = DiscreteGaussian::at_least(
            calibration.noise_multiplier * grid::GRID_UNITS_PER_CLIP as f64,
        )?;
        let round = self.binding.context.round;
        let (values, noise_record) = match privacy.mechanism {
            Mechanism::Gaussian => {
                let seed = noise::seed(
                    private_key,
                    &noise::NoiseBinding {
                        context: &self.binding.context,
                        inputs_digest: &inputs_digest,
                    },
                );
                let mut sum = self.sum.into_sum();
                noise::add(&mut sum, &noise, &seed);
                let values: Vec<f32> = sum
                    .iter()
                    .map(|&units| grid::to_average(units, privacy.clip_norm, count))
                    .collect();
                let record = NoiseRecord::new(&noise, privacy.clip_norm, count);
                (values, record)
            }
            Mechanism::Tree { min_separation } => {
                let trees = dp::tree::Trees {
                    length: min_separation,
                };
                let (tree, position) = trees.locate(round);
                let weights = trees.release(round);
                let seeded: Vec<_> = weights
                    .iter()
                    .map(|(node, weight)| {
                        let context = &self.binding.context;
                        let seed = noise::node_seed(
                            private_key,
                            &context.task_id,
                            &context.policy_sha256,
                            node,
                        );
                        (*weight, seed)
                    })
                    .collect();
                let sum = self.sum.into_sum();
                let mut noised = vec![0f64; sum.len()];
                noise::add_weighted(&mut noised, &noise, &seeded);
                let values: Vec<f32> = sum
                    .iter()
                    .zip(&noised)
                    .map(|(&units, &extra)| {
                        grid::to_average_f64(units as f64 + extra, privacy.clip_norm, count)
                    })
                    .collect();
                let shape = TreeShape {
                    length: min_separation,
                    tree,
                    position,
                    nodes: weights.len() as u64,
                    release_variance: dp::tree::variance(weights.iter().map(|(_, w)| w)),
                    prefix_variance: dp::tree::variance(trees.prefix(tree, position).values()),
                };
                let record = NoiseRecord::tree(
                    &noise,
                    privacy.clip_norm,
                    count,
                    privacy.mechanism.encode(),
                    &shape,
                );
                (values, record)
            }
        };
        let average = encode(&self.schema, &values)?;
        let releases = |round: u64| {
            u32::try_from(dp::releases_through(privacy.mechanism, round)).unwrap_or(u32::MAX)
        };
        let (rho_spent, epsilon_spent) = dp::spent(noise.scale(), releases(round), privacy.delta)?;
        let rho_round = dp::calibrate::rho_at(noise.scale())?
            * f64::from(releases(round) - releases(round.saturating_sub(1)));
        let mut excluded = BTreeMap::new();
        for (_, reason) in &outcome.excluded {
            *excluded.entry(reason.as_str().to_string()).or_insert(0u64) += 1;
        }
        let manifest = Manifest {
            format: manifest::FORMAT.to_string(),
            task_id: self.binding.context.task_id.clone(),
            round: self.binding.context.round,
            key_id: self.binding.key_id.clone(),
            policy_sha256: self.binding.context.policy_sha256.clone(),
            model_sha256: self.binding.context.model_sha256.clone(),
            included: count,
            included_digest,
            inputs_digest,
            excluded,
            excluded_refs: outcome
                .excluded
                .iter()
                .take(LISTED_EXCLUSIONS)
                .map(|(r, reason)| (r.clone(), reason.as_str().to_string()))
                .collect(),
            clip_norm: privacy.clip_norm,
            noise: noise_record,
            privacy: PrivacyRecord {
                epsilon_budget: privacy.epsilon,
                delta: privacy.delta,
                rounds_planned: privacy.rounds,
                noise_multiplier: calibration.noise_multiplier,
                rho_round,
                rho_spent,
                epsilon_spent,
            },
            average_sha256: hex(Sha256::digest(&average)),
        };
        Ok(Release {
            average,
            manifest,
            values,
        })
    }
}

/// SHA-256 (hex) over sorted refs, one per line.
pub fn digest<S: AsRef<str>>(sorted_refs: &[S]) -> String {
    let mut hasher = Sha256::new();
    for r in sorted_refs {
        hasher.update(r.as_ref().as_bytes());
        hasher.update(b"\n");
    }
    hex(hasher.finalize())
}

/// Safetensors of `values` (schema order) with the schema's names and shapes.
pub fn encode(schema: &ModelSchema, values: &[f32]) -> Result<Vec<u8>, ModelError> {
    let mut offset = 0;
    let mut tensors = Vec::with_capacity(schema.tensors().len());
    for spec in schema.tensors() {
        let len: usize = spec.shape.iter().product();
        tensors.push((
            spec.name.as_str(),
            spec.shape.clone(),
            &values[offset..offset + len],
        ));
        offset += len;
    }
    encode_f32_tensors(&tensors)
}

#[cfg(test)]
mod tests;
