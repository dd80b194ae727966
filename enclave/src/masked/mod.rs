//! Masked rounds inside the enclave (docs/secure-aggregation.md): each contribution opens to a
//! masked update (the device's clipped update on the grid plus pseudorandom masks, mod 2^64),
//! which the enclave only adds, wrapping, into one sum; it cannot clip or read a single update,
//! and holds nothing that says more than the sum. After the key services return the included
//! inputs' mask sums, `unmask` removes them (`confed_protocol::masking::unmask`, with its checks)
//! and hands the exact sum to a training `Aggregator`, whose `finish` noises, averages and
//! releases it as any round's.
//!
//! It keeps, for each included input, what the key services need to add its masks (the
//! envelope's `enc`, `token` and `seeds`: `unmask_inputs`); the worker's masked job
//! (`worker::masked`) asks them.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use confed_protocol::device_auth::DeviceAuth;
use confed_protocol::masking::{self, Layout, MaskSums, MaskedProblem, MaskingError};
use confed_worker_api::manifest::MaskingRecord;
use confed_worker_api::model::ModelSchema;
use rayon::prelude::*;
use thiserror::Error;
use zeroize::Zeroizing;

use crate::aggregate::contribution::{self, Binding, Exclusion};
use crate::aggregate::{AggregateError, Aggregator, DistributedNoise, Outcome, PlaintextBuffers};
use crate::hpke::PrivateKey;
use crate::hpke_awslc::Recipient;

/// Values per stripe of the masked sum (128 KiB of u64): threads adding at once rarely wait.
const STRIPE: usize = 16 * 1024;

#[derive(Debug, Error)]
pub enum MaskedError {
    #[error("the masks cannot be removed: {0}")]
    Masking(#[from] MaskingError),
    #[error(transparent)]
    Aggregate(#[from] AggregateError),
    #[error(
        "{included} inputs (and the round's noise) do not fit the task's ring of 2^{bits}: their sum could wrap. The front end chose the ring for the task's largest rounds (report_goal and over_selection); a round this large needs a task created with a smaller report goal or over-selection, which then masks in 2^32, or a larger one, which masks in 2^64"
    )]
    RingTooSmall { included: usize, bits: u32 },
    #[error(
        "{inputs} contributions: the key services unmask at most {limit} inputs of a masked round, in one request. Cancel the task and create it again with report_goal x (1 + max(over_selection, 1)) at most {limit} (the partner API refuses larger masked tasks since this check)"
    )]
    TooManyInputs { inputs: usize, limit: usize },
}

/// Refuses a masked round of more contributions than the key services agree to and sum in one
/// request (`MAX_UNMASK_INPUTS`): checked before the key is asked for, as the ring is.
pub fn check_unmask_inputs(inputs: usize) -> Result<(), MaskedError> {
    let limit = confed_attestation::unmask_api::MAX_UNMASK_INPUTS;
    if inputs > limit {
        return Err(MaskedError::TooManyInputs { inputs, limit });
    }
    Ok(())
}

/// Whether `inputs` inputs' sum, with distributed noise of `noise_variance` per group, fits
/// `layout`'s ring without wrapping (`MaskedAggregator::check_ring`). The job checks the round's
/// contributions before it asks for the key, and the included ones again before the unmask.
pub fn check_ring(
    layout: &Layout,
    inputs: usize,
    noise_variance: Option<u64>,
) -> Result<(), MaskedError> {
    let noise = noise_variance.map_or(0.0, |v| {
        masking::noise_value_bound(v, layout.groups().len())
    });
    let ring = layout.ring();
    let units = confed_protocol::grid::GRID_UNITS_PER_CLIP as u64;
    if ring.holds(inputs as u64, units, noise) {
        return Ok(());
    }
    Err(MaskedError::RingTooSmall {
        included: inputs,
        bits: ring.bits(),
    })
}

pub struct MaskedAggregator {
    binding: Binding,
    layout: Layout,
    values: usize,
    recipient: Recipient,
    stripes: Vec<Mutex<Vec<u64>>>,
    next_start: AtomicUsize,
    outcome: Mutex<Outcome>,
    device_auth: Option<DeviceAuth>,
    buffers: PlaintextBuffers,
    /// Each included input's envelope fields the key services check and open (ref, enc, token,
    /// seeds).
    bound: Mutex<Vec<BoundInput>>,
}

/// An included input as the key services need it (`SumsRequest`'s inputs).
#[derive(Debug, Clone)]
pub struct BoundInput {
    pub assignment_ref: String,
    pub enc: Vec<u8>,
    pub token: Vec<u8>,
    pub seeds: Vec<u8>,
}

/// The exclusion a plaintext that is not a masked update of the round's length is counted under.
fn exclusion_of(problem: &MaskedProblem) -> Exclusion {
    match problem {
        MaskedProblem::Format(_) => Exclusion::NotSafetensors,
        MaskedProblem::Shape(_) => Exclusion::WrongTensors,
    }
}

impl MaskedAggregator {
    /// A masked round of `values` grid values under `layout`'s key services.
    pub fn new(
        binding: Binding,
        layout: Layout,
        values: usize,
        private_key: &PrivateKey,
    ) -> Result<Self, AggregateError> {
        let recipient =
            Recipient::new(private_key).map_err(|e| AggregateError::Key(e.to_string()))?;
        let stripes = (0..values.div_ceil(STRIPE))
            .map(|i| Mutex::new(vec![0u64; STRIPE.min(values - i * STRIPE)]))
            .collect();
        Ok(Self {
            binding,
            layout,
            values,
            recipient,
            stripes,
            next_start: AtomicUsize::new(0),
            outcome: Mutex::default(),
            device_auth: None,
            buffers: PlaintextBuffers::default(),
            bound: Mutex::default(),
        })
    }

    /// Adds only contributions whose device token the policy's `device_auth` accepts.
    pub fn authenticating(mut self, device_auth: Option<DeviceAuth>) -> Self {
        self.device_auth = device_auth;
        self
    }

    /// Adds one stored contribution (`None`: its bytes were missing). Safe to call from many
    /// threads at once.
    pub fn add(&self, assignment_ref: &str, stored: Option<&[u8]>) -> Result<(), Exclusion> {
        let result = self.try_add(assignment_ref, stored);
        self.outcome
            .lock()
            .expect("masked outcome")
            .record(assignment_ref, result);
        result
    }

    fn try_add(&self, assignment_ref: &str, stored: Option<&[u8]>) -> Result<(), Exclusion> {
        let opener = contribution::Opener {
            binding: &self.binding,
            recipient: &self.recipient,
            device_auth: self.device_auth.as_ref(),
            masking: Some(&self.layout),
            buffers: &self.buffers,
        };
        // What the key services need of the input if it is included (the opener parses and
        // checks the same header again before anything is decrypted).
        let bound = stored
            .and_then(|bytes| crate::envelope::EnvelopeRef::parse(bytes).ok())
            .map(|envelope| BoundInput {
                assignment_ref: assignment_ref.to_string(),
                enc: envelope.encapsulated_key.to_vec(),
                token: envelope.token.map(<[u8]>::to_vec).unwrap_or_default(),
                seeds: envelope.seeds.map(<[u8]>::to_vec).unwrap_or_default(),
            });
        opener.open_then(assignment_ref, stored, |plaintext| {
            let data = masking::read_masked(plaintext, self.values, self.layout.ring())
                .map_err(|e| exclusion_of(&e))?;
            self.add_masked(data);
            Ok(())
        })?;
        if let Some(bound) = bound {
            self.bound.lock().expect("masked inputs").push(bound);
        }
        Ok(())
    }

    /// The included inputs' envelope fields, sorted by ref (the included set).
    pub fn unmask_inputs(&self) -> Vec<BoundInput> {
        let mut bound = self.bound.lock().expect("masked inputs").clone();
        bound.sort_by(|a, b| a.assignment_ref.cmp(&b.assignment_ref));
        bound
    }

    /// The round's layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Whether `included` inputs' sum, with distributed noise of `noise_variance` per group,
    /// fits the layout's ring without wrapping (always in 2^64; in 2^32 while `included x 2^16`
    /// and the noise's bound stay below 2^31). Checked before the key services are asked: a
    /// sum that wrapped would unmask to the wrong values.
    pub fn check_ring(
        &self,
        included: usize,
        noise_variance: Option<u64>,
    ) -> Result<(), MaskedError> {
        check_ring(&self.layout, included, noise_variance)
    }

    /// Adds a masked update's little-endian values (of the ring's width), wrapping mod 2^64
    /// (congruent mod 2^32 too: the unmask reduces), stripe by stripe from a stripe that
    /// depends on the thread.
    fn add_masked(&self, data: &[u8]) {
        let count = self.stripes.len();
        let start = self.next_start.fetch_add(1, Ordering::Relaxed);
        let width = self.layout.ring().bytes();
        for step in 0..count {
            let index = (start + step) % count;
            let first = index * STRIPE;
            let mut stripe = self.stripes[index].lock().expect("masked stripe");
            let bytes = &data[first * width..(first + stripe.len()) * width];
            self.layout.ring().accumulate(&mut stripe, bytes);
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
        let outcome = self.outcome.lock().expect("masked outcome");
        (outcome.included.len(), outcome.excluded.len())
    }

    /// The included contributions' refs, sorted: exactly the inputs whose mask sums the key
    /// services are asked for.
    pub fn included(&self) -> Vec<String> {
        let mut included = self
            .outcome
            .lock()
            .expect("masked outcome")
            .included
            .clone();
        included.sort();
        included
    }

    /// Removes the masks with the key services' `answers` (each group's sum from the services
    /// that hold it, all agreeing; the result within what the included clipped updates can add):
    /// a training aggregator holding the exact sum of the included updates and this round's
    /// outcomes, for `finish`, and the manifest's masking record. A withheld, disagreeing or
    /// wrong mask sum fails: nothing is released.
    pub fn unmask(
        self,
        answers: &[MaskSums],
        clip_norm: f64,
        noise_variance: Option<u64>,
        schema: ModelSchema,
        private_key: &PrivateKey,
    ) -> Result<(Aggregator, MaskingRecord), MaskedError> {
        let groups = self.layout.groups().len() as u32;
        let distributed = noise_variance.map(|variance| DistributedNoise { variance, groups });
        self.check_ring(
            self.outcome.lock().expect("masked outcome").included.len(),
            noise_variance,
        )?;
        let outcome = self.outcome.into_inner().expect("masked outcome");
        let masked_sum: Zeroizing<Vec<u64>> = Zeroizing::new(
            self.stripes
                .into_iter()
                .flat_map(|stripe| stripe.into_inner().expect("masked stripe"))
                .collect(),
        );
        let sum = masking::unmask(
            &self.layout,
            &masked_sum,
            answers,
            outcome.included.len() as u64,
            confed_protocol::grid::GRID_UNITS_PER_CLIP,
            distributed.map_or(masking::NoiseRoom::default(), |d| {
                masking::NoiseRoom::of(masked_sum.len(), d.variance, groups as usize)
            }),
        )?;
        // Every answer is from a service of the layout, once (`unmask` checked).
        let mut answered: Vec<u8> = answers.iter().map(|a| a.service).collect();
        answered.sort_unstable();
        let record = MaskingRecord {
            scheme: masking::SCHEME.into(),
            services: self.layout.services(),
            threshold: self.layout.threshold(),
            quorum: self.layout.quorum(),
            groups,
            answered,
            noise_variance_grid: noise_variance,
        };
        let aggregator = Aggregator::from_exact(
            self.binding,
            clip_norm,
            schema,
            private_key,
            &sum,
            outcome,
            distributed,
        )?
        .authenticating(self.device_auth);
        Ok((aggregator, record))
    }
}

mod partition;

#[cfg(test)]
mod auth_tests;
#[cfg(test)]
mod tests;
