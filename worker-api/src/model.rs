//! The model format confed accepts: safetensors whose tensors are all little-endian `F32` and
//! finite. Models, updates and aggregates share this format so a partner can load them in Python.
//!
//! Only `F32` is accepted: the aggregator sums updates in f64 from f32 inputs, and one dtype keeps
//! the contribution check ("exactly the model's names, shapes and dtype") unambiguous.

use safetensors::{Dtype, SafeTensors};
use thiserror::Error;

/// Name and shape of one tensor of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
}

/// The tensors of a model, sorted by name: what every update to it must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSchema {
    tensors: Vec<TensorSpec>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ModelError {
    #[error("not a valid safetensors file: {0}")]
    NotSafetensors(String),
    #[error("the model has no tensors; upload at least one F32 tensor")]
    Empty,
    #[error("tensor `{name}` has dtype {dtype}; confed models must be F32")]
    UnsupportedDtype { name: String, dtype: String },
    #[error("tensor `{name}` holds a non-finite value (NaN or infinity) at element {index}")]
    NonFinite { name: String, index: usize },
    #[error(
        "tensor `{0}`: names starting with `confed.` are reserved for the protocol (an update's `confed.evaluation`, `confed.health` and `confed.examples`); rename the tensor"
    )]
    ReservedName(String),
}

/// Tensor names a model may not use: the protocol's own tensors in updates start with it.
pub const RESERVED_PREFIX: &str = "confed.";

impl ModelSchema {
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// Total number of scalar parameters over all tensors.
    pub fn parameter_count(&self) -> usize {
        self.tensors
            .iter()
            .map(|t| t.shape.iter().product::<usize>())
            .sum()
    }
}

/// Parses and checks a model file: valid safetensors, at least one tensor, all `F32`, all finite,
/// no name with the reserved `confed.` prefix.
pub fn validate_model(bytes: &[u8]) -> Result<ModelSchema, ModelError> {
    let parsed =
        SafeTensors::deserialize(bytes).map_err(|e| ModelError::NotSafetensors(e.to_string()))?;
    let mut tensors = Vec::new();
    for (name, view) in parsed.tensors() {
        if name.starts_with(RESERVED_PREFIX) {
            return Err(ModelError::ReservedName(name));
        }
        if view.dtype() != Dtype::F32 {
            return Err(ModelError::UnsupportedDtype {
                name,
                dtype: format!("{:?}", view.dtype()),
            });
        }
        if let Some(index) = view
            .data()
            .chunks_exact(4)
            .position(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite())
        {
            return Err(ModelError::NonFinite { name, index });
        }
        tensors.push(TensorSpec {
            name,
            shape: view.shape().to_vec(),
        });
    }
    if tensors.is_empty() {
        return Err(ModelError::Empty);
    }
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(ModelSchema { tensors })
}

/// Serializes named F32 tensors as safetensors (used by tests, the simulator and the updater).
/// The model version 0 of every analytics task: one F32 zero named `analytics`. An analytics
/// round trains nothing, but devices and the enclave bind a base model's hash like any round's,
/// so the server stores this fixed stand-in when the task is created (docs/analytics.md).
pub fn analytics_model() -> Vec<u8> {
    encode_f32_tensors(&[("analytics", vec![1], &[0.0])]).expect("one F32 value always encodes")
}

pub fn encode_f32_tensors(tensors: &[(&str, Vec<usize>, &[f32])]) -> Result<Vec<u8>, ModelError> {
    use safetensors::tensor::TensorView;
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, values)| values.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), data)| {
            TensorView::new(Dtype::F32, shape.clone(), data)
                .map(|view| (name.to_string(), view))
                .map_err(|e| ModelError::NotSafetensors(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize(views, None).map_err(|e| ModelError::NotSafetensors(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_model_yields_sorted_schema() {
        let bytes = encode_f32_tensors(&[
            ("w", vec![2, 2], &[1.0, 2.0, 3.0, 4.0]),
            ("b", vec![2], &[0.5, -0.5]),
        ])
        .unwrap();
        let schema = validate_model(&bytes).unwrap();
        let names: Vec<_> = schema.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["b", "w"]);
        assert_eq!(schema.parameter_count(), 6);
    }

    #[test]
    fn a_tensor_named_like_the_protocol_s_is_refused() {
        let bytes = encode_f32_tensors(&[
            ("w", vec![1], &[0.0]),
            ("confed.evaluation", vec![3], &[0.0; 3]),
        ])
        .unwrap();
        assert!(matches!(
            validate_model(&bytes),
            Err(ModelError::ReservedName(name)) if name == "confed.evaluation"
        ));
    }

    #[test]
    fn garbage_is_not_safetensors() {
        assert!(matches!(
            validate_model(b"definitely not a model"),
            Err(ModelError::NotSafetensors(_))
        ));
    }

    #[test]
    fn model_without_tensors_is_refused() {
        let bytes = encode_f32_tensors(&[]).unwrap();
        assert_eq!(validate_model(&bytes), Err(ModelError::Empty));
    }

    #[test]
    fn non_finite_value_is_refused_with_position() {
        let bytes = encode_f32_tensors(&[("w", vec![3], &[1.0, f32::NAN, 2.0])]).unwrap();
        assert_eq!(
            validate_model(&bytes),
            Err(ModelError::NonFinite {
                name: "w".into(),
                index: 1
            })
        );
    }

    #[test]
    fn non_f32_dtype_is_refused() {
        use safetensors::tensor::TensorView;
        let data = [0u8; 4];
        let view = TensorView::new(Dtype::I32, vec![1], &data).unwrap();
        let bytes = safetensors::serialize([("ids", view)], None).unwrap();
        assert!(matches!(
            validate_model(&bytes),
            Err(ModelError::UnsupportedDtype { name, .. }) if name == "ids"
        ));
    }
}
