//! Federated evaluation inside the enclave (docs/privacy.md, "Evaluation"): in an evaluation
//! round each device adds `[loss_sum, correct, examples]` for the model version the round trains
//! from (the `confed.evaluation` tensor). Each device's part is bounded here, never trusted: at
//! most `max_examples` examples (a device claiming more is scaled down to that many), a mean loss
//! in `[0, max_loss]`, at most one correct answer per example. The three parts are summed exactly
//! on a grid of 1/1024 example and released once with discrete Gaussian noise keyed like the
//! round's value noise under their own label, so a retried job reproduces them and any other
//! inputs get independent noise.

use std::sync::atomic::{AtomicI64, Ordering};

use confed_worker_api::manifest::EvaluationRecord;

use super::AggregateError;
use super::contribution::Binding;
use super::noise;
use crate::dp::DiscreteGaussian;
use crate::dp::accounting::EVALUATION_UNITS_PER_EXAMPLE;
use crate::hpke::PrivateKey;
use crate::policy::Evaluation;

const UNITS: f64 = EVALUATION_UNITS_PER_EXAMPLE as f64;

/// One device's evaluation on the grid: `[loss_sum / max_loss, correct, examples]`, each in
/// `[0, max_examples * 1024]` units, so the L2 sensitivity the accounting assumes
/// (`dp::accounting::evaluation_rho`) holds exactly. Metrics with a NaN or an infinity count as
/// none (zeros): excluding the device's whole update for them would publish, in the manifest's
/// exclusions, that its private data gave an infinite loss.
pub fn bound(evaluation: &Evaluation, tensor: &[u8]) -> [i64; 3] {
    let mut raw = [0f64; 3];
    for (value, bytes) in raw.iter_mut().zip(tensor.chunks_exact(4)) {
        *value = f64::from(f32::from_le_bytes(bytes.try_into().expect("4 bytes")));
    }
    if raw.iter().any(|v| !v.is_finite()) {
        return [0; 3];
    }
    let [loss_sum, correct, examples] = raw.map(|v| v.max(0.0));
    let max_examples = f64::from(evaluation.max_examples);
    // More examples than the bound: the device's measurements are scaled to `max_examples`
    // examples, which keeps its mean loss and accuracy.
    let scale = if examples > max_examples {
        max_examples / examples
    } else {
        1.0
    };
    let examples = examples * scale;
    let correct = (correct * scale).min(examples);
    let loss = (loss_sum * scale / evaluation.max_loss).min(examples);
    let cap = i64::from(evaluation.max_examples) * EVALUATION_UNITS_PER_EXAMPLE;
    [loss, correct, examples].map(|v| ((v * UNITS).round() as i64).clamp(0, cap))
}

/// The exact sums of an evaluation round's included contributions, added from many threads.
#[derive(Default)]
pub struct Sums([AtomicI64; 3]);

impl Sums {
    pub fn add(&self, units: [i64; 3]) {
        for (sum, value) in self.0.iter().zip(units) {
            sum.fetch_add(value, Ordering::Relaxed);
        }
    }

    pub(super) fn take(self) -> [i64; 3] {
        self.0.map(AtomicI64::into_inner)
    }
}

/// Noises the sums once and makes the record; returns it with the noise's scale (grid units).
pub fn release(
    evaluation: &Evaluation,
    on_demand: bool,
    sums: Sums,
    private_key: &PrivateKey,
    binding: &Binding,
) -> Result<(EvaluationRecord, f64), AggregateError> {
    let noise = DiscreteGaussian::at_least(evaluation.stddev * UNITS)?;
    let seed = noise::evaluation_seed(
        private_key,
        &noise::NoiseBinding {
            context: &binding.context,
            inputs_digest: &binding.inputs_digest,
        },
    );
    let mut noised = sums.take();
    noise::add(&mut noised, &noise, &seed);
    let [loss, correct, examples] = noised.map(|units| units as f64 / UNITS);
    let loss_sum = loss * evaluation.max_loss;
    let positive = examples > 0.0;
    let record = EvaluationRecord {
        model_version: binding.context.round.saturating_sub(1),
        on_demand,
        max_loss: evaluation.max_loss,
        max_examples: evaluation.max_examples,
        stddev: noise.scale() / UNITS,
        examples,
        correct,
        loss_sum,
        accuracy: positive.then(|| (correct / examples).clamp(0.0, 1.0)),
        loss: positive.then(|| (loss_sum / examples).clamp(0.0, evaluation.max_loss)),
    };
    Ok((record, noise.scale()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn evaluation() -> Evaluation {
        Evaluation {
            every: 1,
            max_loss: 4.0,
            max_examples: 10,
            stddev: 1.0,
            on_demand: 0,
        }
    }

    fn bytes(values: [f32; 3]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn a_device_within_the_bounds_is_summed_as_it_said() {
        let units = bound(&evaluation(), &bytes([6.0, 3.0, 5.0]));
        assert_eq!(units, [1536, 3072, 5120], "loss 6 of max 4 = 1.5 examples");
    }

    #[test]
    fn a_device_beyond_the_bounds_is_cut_to_them() {
        let cap = 10 * 1024;
        // 20 examples: scaled to 10, mean loss and accuracy kept.
        assert_eq!(
            bound(&evaluation(), &bytes([40.0, 10.0, 20.0])),
            [5 * 1024, 5 * 1024, cap]
        );
        // More correct than examples, a loss above the bound, negative values, the largest f32
        // (scaled to 10 examples, its mean loss f32::MAX / f32::MAX = 1, a quarter of the bound).
        assert_eq!(
            bound(&evaluation(), &bytes([1e9, 1e9, 10.0])),
            [cap, cap, cap]
        );
        assert_eq!(bound(&evaluation(), &bytes([-5.0, -1.0, -3.0])), [0, 0, 0]);
        assert_eq!(
            bound(&evaluation(), &bytes([f32::MAX, f32::MAX, f32::MAX])),
            [10 * 1024 / 4, cap, cap]
        );
        // Not finite: counted as no metrics, never excluding the update.
        assert_eq!(
            bound(&evaluation(), &bytes([1.0, 1.0, f32::INFINITY])),
            [0, 0, 0]
        );
        assert_eq!(
            bound(&evaluation(), &bytes([f32::NAN, 1.0, 1.0])),
            [0, 0, 0]
        );
    }
}
