//! Aggregation inside the enclave: open each contribution, check it, clip it, add it to an exact
//! integer sum (in parallel, streaming: a contribution's plaintext lives only while it is added),
//! then noise the sum once and release the average with a manifest. The un-noised sum never
//! leaves this module: `finish` consumes it.

pub mod accumulator;
pub mod blt_round;
pub mod blt_state;
pub mod contribution;
pub mod evaluation;
mod finish;
pub mod health;
pub mod inputs;
pub mod manifest;
pub mod noise;
pub mod params;
pub mod partition;
mod quantize;
pub mod sealed;
pub mod stream;

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use rayon::prelude::*;
use thiserror::Error;
use zeroize::Zeroizing;

use crate::dp::{self, DpError};
use crate::envelope::EnvelopeRef;
use crate::hpke::PrivateKey;
use crate::hpke_awslc::Recipient;
use crate::policy::{Evaluation, Health, Weighting};
use accumulator::{Accumulator, StreamError};
pub(crate) use confed_protocol::hex::encode as hex;
use confed_worker_api::model::{ModelError, ModelSchema, encode_f32_tensors};
pub use contribution::{Binding, Exclusion, Sides};
pub use manifest::{
    AdaptiveRecord, EvaluationRecord, Manifest, NoiseRecord, PrivacyRecord, TreeRecord, TreeShape,
    noise_record, tree_noise_record,
};
pub use params::PrivacyParams;
use stream::StreamProblem;

/// Models of at least this many bytes of values are aggregated chunk by chunk: a thread then
/// holds one chunk of plaintext (1 MiB) instead of a whole update, and decrypts the update twice
/// (measured, then added) where a held one is decrypted once. A constant, not a share of the
/// worker's cores or memory: the host controls those, and the two paths check a malformed header
/// in different orders (an exclusion's reason can differ), so the path must be the model's alone.
/// A worker holds at most this much update plaintext per thread for chunked envelopes (what the
/// reference clients send above 1 MiB); an unchunked or unstreamable one is held whole.
pub const STREAM_ABOVE_BYTES: usize = 64 << 20;

/// An update holding a NaN or an infinity is included as a zero update (nothing of it is added;
/// it counts as one contribution, and as unclipped, which a zero update is). Excluding it would
/// publish, exactly and without noise, one bit that the device's data decides: a model chosen
/// by a tenant or the operator can make training overflow on a chosen condition of a device's
/// private data (docs/privacy.md, "What leaves a device"). A buggy or malicious device's NaN
/// costs its own contribution, nothing more.
const ZERO_UPDATE_IS_WITHIN: bool = true;

/// Excluded refs listed one by one in the manifest, at most (counts are always complete).
pub(crate) const LISTED_EXCLUSIONS: usize = 1000;

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
    #[error(
        "the aggregator was {} evaluation metrics, but the policy's round {round} {}",
        if *.collected { "collecting" } else { "not collecting" },
        if *.collected { "evaluates nothing" } else { "is an evaluation round" }
    )]
    EvaluationMismatch { collected: bool, round: u64 },
    #[error("{0}")]
    Unsupported(String),
    #[error(
        "the round's open domain holds too many distinct keys for the enclave's table (noised count {noised}, at most {limit} allowed); nothing released (docs/privacy.md, \"Analytics\")"
    )]
    TooManyKeys { noised: i64, limit: u64 },
    #[error(transparent)]
    BltState(#[from] blt_state::StateError),
    #[error("BLT noise: {0}")]
    Blt(#[from] dp::blt::BltError),
}

pub struct Aggregator {
    binding: Binding,
    clip_norm: f64,
    schema: ModelSchema,
    recipient: Recipient,
    sum: Accumulator,
    outcome: Mutex<Outcome>,
    next_start: AtomicUsize,
    /// Included updates whose norm was at most the clip norm.
    unclipped: AtomicU64,
    /// An evaluation round's parameters and its metric sums (`evaluating`).
    evaluation: Option<(Evaluation, evaluation::Sums)>,
    /// The health signal's parameters and its count (`watching_health`).
    health: Option<health::Watch>,
    /// Example-weighted averaging's cap (`weighing`): each update is added times its weight.
    weighting: Option<Weighting>,
    buffers: PlaintextBuffers,
    /// Updates of at least this many bytes of values are streamed (`stream.rs`).
    stream_above: usize,
    /// The policy's device-token requirement: only contributions it authenticates are added.
    device_auth: Option<confed_protocol::device_auth::DeviceAuth>,
    /// BLT noise only: the sealed state the round continues (`None` in round 1).
    blt_state: Option<Vec<u8>>,
    /// A masked round with distributed noise: the sum already carries the key services' noise,
    /// and `finish` adds none of its own.
    distributed_noise: Option<DistributedNoise>,
}

/// A masked round's distributed noise (docs/secure-aggregation.md, "Distributed noise"): `groups`
/// independent discrete Gaussians of integer variance `variance` (grid units squared) per value,
/// one drawn by each group's holders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DistributedNoise {
    pub variance: u64,
    pub groups: u32,
}

/// Plaintext buffers reused across contributions (no allocation and page faults per
/// contribution), one per thread at a time, wiped when the aggregator is dropped.
#[derive(Default)]
pub(crate) struct PlaintextBuffers(Mutex<Vec<Zeroizing<Vec<u8>>>>);

impl PlaintextBuffers {
    /// Runs `f` with a buffer from the pool and gives it back.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut Vec<u8>) -> R) -> R {
        let mut buffer = self
            .0
            .lock()
            .expect("plaintext buffers")
            .pop()
            .unwrap_or_default();
        let result = f(&mut buffer);
        self.0.lock().expect("plaintext buffers").push(buffer);
        result
    }
}

/// Which contributions a round included and excluded (why), as they were added.
#[derive(Default)]
pub struct Outcome {
    pub(crate) included: Vec<String>,
    pub(crate) excluded: Vec<(String, Exclusion)>,
}

impl Outcome {
    /// Records one contribution's result.
    pub(crate) fn record(&mut self, assignment_ref: &str, result: Result<(), Exclusion>) {
        match result {
            Ok(()) => self.included.push(assignment_ref.to_string()),
            Err(reason) => self.excluded.push((assignment_ref.to_string(), reason)),
        }
    }

    /// Sorted (the manifest lists refs in order), and checked to have at least `min_reports`
    /// included contributions (a round with fewer releases nothing).
    pub(crate) fn releasable(mut self, min_reports: u32) -> Result<Self, AggregateError> {
        self.included.sort();
        self.excluded.sort();
        let count = self.included.len() as u64;
        if count == 0 {
            return Err(AggregateError::NothingIncluded(self.excluded.len() as u64));
        }
        if count < u64::from(min_reports) {
            return Err(AggregateError::TooFewIncluded {
                included: count,
                excluded: self.excluded.len() as u64,
                min_reports,
            });
        }
        Ok(self)
    }

    /// Excluded contributions per reason.
    pub(crate) fn excluded_counts(&self) -> std::collections::BTreeMap<String, u64> {
        let mut excluded = std::collections::BTreeMap::new();
        for (_, reason) in &self.excluded {
            *excluded.entry(reason.as_str().to_string()).or_insert(0u64) += 1;
        }
        excluded
    }

    /// The first `LISTED_EXCLUSIONS` excluded refs with their reasons.
    pub(crate) fn listed_exclusions(&self) -> Vec<(String, String)> {
        self.excluded
            .iter()
            .take(LISTED_EXCLUSIONS)
            .map(|(r, reason)| (r.clone(), reason.as_str().to_string()))
            .collect()
    }
}

/// The noised, averaged result of a round: what may leave the enclave.
pub struct Release {
    /// The noised average update, safetensors with the model's tensors.
    pub average: Vec<u8>,
    pub manifest: Manifest,
    /// The average as f32 values in schema order (for the model updater).
    pub values: Vec<f32>,
    /// BLT noise only: the sealed state the round leaves for the next.
    pub blt_state: Option<Vec<u8>>,
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
            unclipped: AtomicU64::new(0),
            evaluation: None,
            health: None,
            weighting: None,
            buffers: PlaintextBuffers::default(),
            stream_above: STREAM_ABOVE_BYTES,
            device_auth: None,
            blt_state: None,
            distributed_noise: None,
        })
    }

    /// An aggregator that already holds `sum`, the exact sum on the grid of the included
    /// contributions `outcome` names (a masked round's, unmasked: `masked::MaskedAggregator`),
    /// ready to `finish` as if it had added them itself. `sum` must be within what that many
    /// clipped updates can add (the caller checked it). Adaptive clipping's count stays 0 and no
    /// side sums are held: a masked job must refuse policies that need them (docs/secure-
    /// aggregation.md, "Order of work").
    pub(crate) fn from_exact(
        binding: Binding,
        clip_norm: f64,
        schema: ModelSchema,
        private_key: &PrivateKey,
        sum: &[i64],
        outcome: Outcome,
        distributed_noise: Option<DistributedNoise>,
    ) -> Result<Self, AggregateError> {
        let mut aggregator = Self::new(binding, clip_norm, schema, private_key)?;
        aggregator.distributed_noise = distributed_noise;
        if sum.len() != aggregator.sum.len() {
            return Err(AggregateError::Unsupported(format!(
                "a sum of {} values for a model of {}",
                sum.len(),
                aggregator.sum.len()
            )));
        }
        aggregator.sum.add_exact(sum);
        *aggregator.outcome.lock().expect("aggregation outcome") = outcome;
        Ok(aggregator)
    }

    /// Collects evaluation metrics (`PrivacyParams::evaluation_in` of the round): devices' metric
    /// tensors are then accepted and summed; without it they are refused. `finish` checks it
    /// agrees with the policy.
    pub fn evaluating(mut self, evaluation: Option<Evaluation>) -> Self {
        self.evaluation = evaluation.map(|e| (e, evaluation::Sums::default()));
        self
    }

    /// Counts the devices that sent zeros (`health`, the policy's): every update must then carry
    /// the health tensor, and without it none may.
    pub fn watching_health(mut self, health: Option<Health>) -> Self {
        self.health = health.map(health::Watch::new);
        self
    }

    /// Weighs each update by its example count (`weighting`, the policy's): every update must
    /// then carry the count, and without it none may.
    pub fn weighing(mut self, weighting: Option<Weighting>) -> Self {
        self.weighting = weighting;
        self
    }

    /// The side tensors this round's updates carry.
    fn sides(&self) -> Sides {
        Sides {
            evaluating: self.evaluation.is_some(),
            health: self.health.is_some(),
            weighting: self.weighting.is_some(),
        }
    }

    /// The weight of an update whose example count tensor holds `examples` (1 without
    /// weighting; a count that is missing or not 4 bytes weighs 0, though the layout checks
    /// refuse such an update before).
    fn weight(&self, examples: Option<&[u8]>) -> f64 {
        match self.weighting {
            None => 1.0,
            Some(weighting) => examples
                .and_then(|bytes| <[u8; 4]>::try_from(bytes).ok())
                .map_or(0.0, |bytes| weighting.weight(f32::from_le_bytes(bytes))),
        }
    }

    /// Adds only contributions whose device token the policy's `device_auth` accepts (the policy
    /// the contributions are bound to); the manifest then says how many were authenticated.
    pub fn authenticating(
        mut self,
        device_auth: Option<confed_protocol::device_auth::DeviceAuth>,
    ) -> Self {
        self.device_auth = device_auth;
        self
    }

    /// Continues BLT noise from `sealed`, the state round `round - 1` left (`blt_round`; checked
    /// before the key with `blt_round::check_before_key`, opened in `finish`).
    pub fn continuing(mut self, sealed: Option<Vec<u8>>) -> Self {
        self.blt_state = sealed;
        self
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
        self.outcome
            .lock()
            .expect("aggregation outcome")
            .record(assignment_ref, result);
        result
    }

    fn try_add(&self, assignment_ref: &str, stored: Option<&[u8]>) -> Result<(), Exclusion> {
        let stored = stored.ok_or(Exclusion::Missing)?;
        let envelope = contribution::parse(&self.binding, stored)?;
        // A token is checked before anything is decrypted: an unauthenticated contribution
        // costs one signature check, and nothing of it reaches the sum.
        if let Some(auth) = &self.device_auth {
            contribution::authenticate(auth, &self.binding, assignment_ref, &envelope, None)?;
        }
        self.buffers
            .with(|plaintext| self.add_plaintext(assignment_ref, envelope, plaintext))
    }

    fn add_plaintext(
        &self,
        assignment_ref: &str,
        envelope: EnvelopeRef<'_>,
        plaintext: &mut Vec<u8>,
    ) -> Result<(), Exclusion> {
        // Large chunked updates go straight from each decrypted chunk into the sum.
        if self.schema.parameter_count() * 4 >= self.stream_above
            && let Some(update) = stream::ChunkedUpdate::new(
                &self.recipient,
                envelope,
                &self.binding.context,
                assignment_ref,
                &self.schema,
                self.sides(),
            )
        {
            // Read twice whatever it holds: measured (its example count passes), then added
            // scaled and weighed (weight 1 without a weighting policy).
            let weight = || self.weight(update.examples().as_ref().map(|b| &b[..]));
            let streamed = self
                .sum
                .add_weighted_stream(&update, self.clip_norm, weight);
            let added = match streamed {
                Ok(within) => Some((within, false)),
                Err(StreamError::NonFinite) => Some((ZERO_UPDATE_IS_WITHIN, true)),
                Err(StreamError::Source(StreamProblem::Excluded(why))) => return Err(why),
                Err(StreamError::Source(StreamProblem::Buffer)) => None,
            };
            if let Some((within, non_finite)) = added {
                self.count_unclipped(within);
                if let Some(bytes) = update.metrics() {
                    self.add_metrics(&bytes);
                }
                self.count_health(update.health().as_ref().map(|b| &b[..]), non_finite);
                return Ok(());
            }
        }
        contribution::open(
            &self.recipient,
            &self.binding,
            assignment_ref,
            &envelope,
            plaintext,
        )?;
        let tensors = contribution::tensors(&self.schema, plaintext, self.sides())?;
        let start = self.next_start.fetch_add(1, Ordering::Relaxed);
        let weight = self.weight(tensors.examples);
        let added = self
            .sum
            .add_weighted(&tensors.model, self.clip_norm, weight, start);
        self.count_unclipped(added.unwrap_or(ZERO_UPDATE_IS_WITHIN));
        // Only after the update is in: a contribution is in every sum or in none.
        if let Some(bytes) = tensors.metrics {
            self.add_metrics(bytes);
        }
        self.count_health(tensors.health, added.is_err());
        Ok(())
    }

    /// Counts an included contribution in the health signal (under a health policy): it sent
    /// zeros if its flag says so or its values were not finite (summed as zeros).
    fn count_health(&self, flag: Option<&[u8]>, non_finite: bool) {
        if let Some(watch) = &self.health {
            watch.count(non_finite || flag.is_some_and(health::flagged));
        }
    }

    /// Adds an included contribution's metrics tensor to the evaluation sums (bounded).
    fn add_metrics(&self, bytes: &[u8]) {
        if let Some((params, sums)) = &self.evaluation {
            sums.add(evaluation::bound(params, bytes));
        }
    }

    /// Counts an included update whose norm was at most the clip norm (adaptive clipping's `b_i`).
    fn count_unclipped(&self, within: bool) {
        if within {
            self.unclipped.fetch_add(1, Ordering::Relaxed);
        }
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
}

/// SHA-256 (hex) over sorted refs, one per line.
pub fn digest<S: AsRef<str>>(sorted_refs: &[S]) -> String {
    // One formula with the unmask agreement's, so a masked release names the set it unmasked.
    confed_attestation::unmask::included_digest(sorted_refs)
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
pub(crate) mod auth_tests;
#[cfg(test)]
mod blt_tests;
#[cfg(test)]
mod evaluation_tests;
#[cfg(test)]
mod health_tests;
#[cfg(test)]
mod partition_tests;
#[cfg(test)]
mod path_tests;
#[cfg(test)]
pub(crate) mod tests;
#[cfg(test)]
mod weighting_tests;
