//! The model updater: the server optimizer's step (`optimizer.rs`; FedAvg by default: version
//! N+1 = version N + server_learning_rate x the noised average update), tensor by tensor,
//! computed in f64 and stored as F32 safetensors with the same names and shapes, with the
//! optimizer's new state beside it. Deterministic, so a retried job writes the same bytes.

use safetensors::SafeTensors;
use thiserror::Error;

use crate::aggregate;
use crate::optimizer::Step;
use confed_worker_api::model::{ModelError, ModelSchema};
use confed_worker_api::optimizer::{OptimizerError, OptimizerState, ServerOptimizer};

#[derive(Debug, Error)]
pub enum UpdateError {
    #[error("the base model is invalid: {0}")]
    BaseModel(ModelError),
    #[error("the average has {got} values but the model has {expected}")]
    Shape { got: usize, expected: usize },
    #[error("the updated model is not finite (learning rate {0} too large for this update?)")]
    NonFinite(f64),
    #[error(transparent)]
    Encode(#[from] ModelError),
    #[error(transparent)]
    Optimizer(#[from] OptimizerError),
}

/// A model version and, for optimizers with state, its optimizer state file.
#[derive(Debug, Clone, PartialEq)]
pub struct Updated {
    pub model: Vec<u8>,
    pub optimizer_state: Option<Vec<u8>>,
}

/// Applies `average` (schema order, as released) to `base` with FedAvg and `learning_rate`.
pub fn apply(
    base: &[u8],
    schema: &ModelSchema,
    average: &[f32],
    learning_rate: f64,
) -> Result<Vec<u8>, UpdateError> {
    Ok(apply_with(
        base,
        schema,
        average,
        learning_rate,
        &ServerOptimizer::FedAvg,
        None,
    )?
    .model)
}

/// Applies `average` to `base`, whose schema (`validate_model`) the caller already has, with
/// `optimizer` from its `state` file (`None` before its first round, and for FedAvg).
pub fn apply_with(
    base: &[u8],
    schema: &ModelSchema,
    average: &[f32],
    learning_rate: f64,
    optimizer: &ServerOptimizer,
    state: Option<&[u8]>,
) -> Result<Updated, UpdateError> {
    if schema.parameter_count() != average.len() {
        return Err(UpdateError::Shape {
            got: average.len(),
            expected: schema.parameter_count(),
        });
    }
    let mut values = average_values(schema, base).map_err(UpdateError::BaseModel)?;
    let state = match (optimizer.has_state(), state) {
        (true, Some(bytes)) => Some(OptimizerState::decode(bytes)?),
        _ => None,
    };
    let state = optimizer.step(&mut values, average, learning_rate, state)?;
    if values.iter().any(|v| !v.is_finite()) {
        return Err(UpdateError::NonFinite(learning_rate));
    }
    Ok(Updated {
        model: aggregate::encode(schema, &values)?,
        optimizer_state: state.map(|s| s.encode()).transpose()?,
    })
}

/// The values of a released average (safetensors) in schema order.
pub fn average_values(schema: &ModelSchema, average: &[u8]) -> Result<Vec<f32>, ModelError> {
    let parsed =
        SafeTensors::deserialize(average).map_err(|e| ModelError::NotSafetensors(e.to_string()))?;
    let mut values = Vec::with_capacity(schema.parameter_count());
    for spec in schema.tensors() {
        let view = parsed
            .tensor(&spec.name)
            .map_err(|e| ModelError::NotSafetensors(e.to_string()))?;
        if view.shape() != spec.shape.as_slice() {
            return Err(ModelError::NotSafetensors(format!(
                "tensor `{}` has shape {:?}, the model {:?}",
                spec.name,
                view.shape(),
                spec.shape
            )));
        }
        values.extend(
            view.data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use confed_worker_api::model::{encode_f32_tensors, validate_model};

    #[test]
    fn fedavg_step_moves_the_model_by_the_learning_rate_times_the_average() {
        let base =
            encode_f32_tensors(&[("b", vec![1], &[1.0]), ("w", vec![2], &[2.0, 3.0])]).unwrap();
        let next = apply(
            &base,
            &validate_model(&base).unwrap(),
            &[0.5, -1.0, 1.0],
            0.5,
        )
        .unwrap();
        let schema = validate_model(&next).unwrap();
        assert_eq!(
            average_values(&schema, &next).unwrap(),
            vec![1.25, 1.5, 3.5]
        );
    }

    #[test]
    fn an_average_of_the_wrong_size_is_refused() {
        let base = encode_f32_tensors(&[("w", vec![2], &[2.0, 3.0])]).unwrap();
        let schema = validate_model(&base).unwrap();
        assert!(matches!(
            apply(&base, &schema, &[1.0], 1.0),
            Err(UpdateError::Shape { .. })
        ));
    }
}
