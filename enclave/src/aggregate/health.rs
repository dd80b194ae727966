//! The noised health signal (docs/privacy.md, "Health"): under a policy that names `health`,
//! every update carries the device's "I sent zeros" flag (`HEALTH_TENSOR`, F32 `[1]`), the
//! enclave counts the included contributions that carried it or whose values were not finite
//! (summed as zeros, `ZERO_UPDATE_IS_WITHIN`), and releases that count once, with discrete
//! Gaussian noise keyed like the round's value noise under its own label. Each device adds 0 or
//! 1, so the sensitivity is 1 and the accounting charges it like adaptive clipping's count.
//!
//! Whether a device's training failed or ran late is a bit its data can decide (a model chosen
//! by a tenant can make it so), so it never leaves exactly: not in the update's size or shape
//! (the flag is always there), not in the manifest (only the noised count).

use std::sync::atomic::{AtomicU64, Ordering};

use super::{AggregateError, Binding, noise};
use crate::dp::DiscreteGaussian;
use crate::hpke::PrivateKey;
use crate::policy::Health;
use confed_worker_api::manifest::HealthRecord;

/// Bytes of the health tensor's data: one little-endian f32.
pub const FLAG_BYTES: usize = 4;

/// Whether a health tensor's value says the device sent zeros: anything but 0 (a NaN too), so a
/// device cannot hide a failure behind a value the enclave does not expect.
pub fn flagged(data: &[u8]) -> bool {
    let bytes: [u8; FLAG_BYTES] = data.try_into().unwrap_or([0xff; FLAG_BYTES]);
    f32::from_le_bytes(bytes) != 0.0
}

/// The round's health parameters and its exact count, shared by the aggregating threads.
#[derive(Debug)]
pub struct Watch {
    pub params: Health,
    zeroed: AtomicU64,
}

impl Watch {
    pub fn new(params: Health) -> Self {
        Self {
            params,
            zeroed: AtomicU64::new(0),
        }
    }

    /// Counts one included contribution: `zeroed` when its flag said so or its values were not
    /// finite.
    pub fn count(&self, zeroed: bool) {
        // Without a branch on the flag: the same work whatever it says.
        self.zeroed.fetch_add(u64::from(zeroed), Ordering::Relaxed);
    }

    /// Adds a merged partition's exact count.
    pub fn add(&self, zeroed: u64) {
        self.zeroed.fetch_add(zeroed, Ordering::Relaxed);
    }

    /// The count so far (tests).
    #[cfg(test)]
    pub fn zeroed(&self) -> u64 {
        self.zeroed.load(Ordering::Relaxed)
    }

    /// The exact count: leaves the enclave only sealed (a partition) or noised (`release`).
    pub fn take(self) -> u64 {
        self.zeroed.into_inner()
    }
}

/// Noises the count once and makes the record; returns it with the noise's scale (devices).
pub fn release(
    params: &Health,
    zeroed: u64,
    private_key: &PrivateKey,
    binding: &Binding,
) -> Result<(HealthRecord, f64), AggregateError> {
    let noise = DiscreteGaussian::at_least(params.stddev)?;
    let seed = noise::health_seed(
        private_key,
        &noise::NoiseBinding {
            context: &binding.context,
            inputs_digest: &binding.inputs_digest,
        },
    );
    let noised = zeroed as i64 + noise::samples(1, &noise, &seed)[0];
    let record = HealthRecord {
        zeroed: noised,
        stddev: noise.scale(),
    };
    Ok((record, noise.scale()))
}
