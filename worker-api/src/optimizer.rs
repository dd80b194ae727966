//! A task's server optimizer as the store, the API and the enclave name it, and the format of its
//! state file. The step itself (Reddi et al., "Adaptive Federated Optimization") is the model
//! updater's, in the enclave (`confed_enclave::optimizer`); the front end only checks that a
//! stored state fits its task.

use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::model::{ModelError, encode_f32_tensors};

/// A task's server optimizer and its hyperparameters.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "name", deny_unknown_fields)]
pub enum ServerOptimizer {
    /// FedAvg: the model moves by the learning rate times the average update.
    #[default]
    #[serde(rename = "fedavg")]
    FedAvg,
    /// FedAvg with server momentum.
    #[serde(rename = "fedavgm")]
    FedAvgM {
        #[serde(default = "default_momentum")]
        momentum: f64,
    },
    #[serde(rename = "fedadam")]
    FedAdam {
        #[serde(default = "default_beta1")]
        beta1: f64,
        #[serde(default = "default_beta2")]
        beta2: f64,
        #[serde(default = "default_tau")]
        tau: f64,
    },
    #[serde(rename = "fedyogi")]
    FedYogi {
        #[serde(default = "default_beta1")]
        beta1: f64,
        #[serde(default = "default_beta2")]
        beta2: f64,
        #[serde(default = "default_tau")]
        tau: f64,
    },
}

fn default_momentum() -> f64 {
    0.9
}
fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.99
}
fn default_tau() -> f64 {
    1e-3
}

#[derive(Debug, Error)]
pub enum OptimizerError {
    #[error("{0}")]
    Invalid(String),
    #[error("the optimizer state is not usable: {0}")]
    State(String),
    #[error(transparent)]
    Encode(#[from] ModelError),
}

impl ServerOptimizer {
    /// Checks the hyperparameters: momentum and betas in [0, 1), tau in (0, 1].
    pub fn validate(&self) -> Result<(), String> {
        let unit = |name: &str, value: f64| {
            if (0.0..1.0).contains(&value) {
                Ok(())
            } else {
                Err(format!("`{name}` must be in [0, 1) (got {value})"))
            }
        };
        let tau = |value: f64| {
            if value > 0.0 && value <= 1.0 {
                Ok(())
            } else {
                Err(format!("`tau` must be in (0, 1] (got {value})"))
            }
        };
        match *self {
            Self::FedAvg => Ok(()),
            Self::FedAvgM { momentum } => unit("momentum", momentum),
            Self::FedAdam {
                beta1,
                beta2,
                tau: t,
            }
            | Self::FedYogi {
                beta1,
                beta2,
                tau: t,
            } => {
                unit("beta1", beta1)?;
                unit("beta2", beta2)?;
                tau(t)
            }
        }
    }

    /// The optimizer's name as the API spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Self::FedAvg => "fedavg",
            Self::FedAvgM { .. } => "fedavgm",
            Self::FedAdam { .. } => "fedadam",
            Self::FedYogi { .. } => "fedyogi",
        }
    }

    /// Whether the optimizer keeps state between rounds.
    pub fn has_state(&self) -> bool {
        !matches!(self, Self::FedAvg)
    }
}

/// An optimizer's moments, one value per model coordinate (schema order).
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerState {
    pub m: Vec<f32>,
    /// The second moment (FedAdam, FedYogi).
    pub v: Option<Vec<f32>>,
}

impl OptimizerState {
    /// The state before the first round: `m = 0` and (adaptive optimizers) `v = v0`.
    pub fn zeros(n: usize, v: Option<f64>) -> Self {
        Self {
            m: vec![0.0; n],
            v: v.map(|init| vec![init as f32; n]),
        }
    }

    /// Whether this state can be `optimizer`'s over a model of `n` coordinates: the right
    /// moments, of the right length, finite.
    pub fn fits(&self, optimizer: &ServerOptimizer, n: usize) -> Result<(), OptimizerError> {
        if !optimizer.has_state() {
            return Err(OptimizerError::State(format!(
                "{} keeps no state",
                optimizer.name()
            )));
        }
        self.check(n, !matches!(optimizer, ServerOptimizer::FedAvgM { .. }))
    }

    /// Whether the moments fit a model of `n` coordinates (`adaptive`: with `v`) and are finite.
    pub fn check(&self, n: usize, adaptive: bool) -> Result<(), OptimizerError> {
        let bad = |what: String| Err(OptimizerError::State(what));
        if self.m.len() != n {
            return bad(format!("m has {} values, the model {n}", self.m.len()));
        }
        match (&self.v, adaptive) {
            (Some(v), true) if v.len() == n => {}
            (None, false) => {}
            (Some(v), true) => return bad(format!("v has {} values, the model {n}", v.len())),
            (None, true) => return bad("an adaptive optimizer's state lacks v".into()),
            (Some(_), false) => return bad("momentum's state has a v".into()),
        }
        if self
            .m
            .iter()
            .chain(self.v.iter().flatten())
            .any(|x| !x.is_finite())
        {
            return bad("a moment is not finite".into());
        }
        Ok(())
    }

    /// The state file: safetensors with F32 tensors `m` and (adaptive optimizers) `v`, each
    /// one-dimensional over the model's coordinates in schema order.
    pub fn encode(&self) -> Result<Vec<u8>, OptimizerError> {
        let n = self.m.len();
        let mut tensors = vec![("m", vec![n], self.m.as_slice())];
        if let Some(v) = &self.v {
            tensors.push(("v", vec![n], v.as_slice()));
        }
        Ok(encode_f32_tensors(&tensors)?)
    }

    /// Reads a state file (untrusted: the store keeps it); `step` checks its sizes.
    pub fn decode(bytes: &[u8]) -> Result<Self, OptimizerError> {
        let parsed =
            SafeTensors::deserialize(bytes).map_err(|e| OptimizerError::State(e.to_string()))?;
        let read = |name: &str| -> Result<Option<Vec<f32>>, OptimizerError> {
            let Ok(view) = parsed.tensor(name) else {
                return Ok(None);
            };
            if view.dtype() != safetensors::Dtype::F32 || view.shape().len() != 1 {
                return Err(OptimizerError::State(format!(
                    "`{name}` must be a one-dimensional F32 tensor"
                )));
            }
            Ok(Some(
                view.data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ))
        };
        let m = read("m")?.ok_or_else(|| OptimizerError::State("no tensor `m`".into()))?;
        let v = read("v")?;
        if parsed.names().len() != 1 + usize::from(v.is_some()) {
            return Err(OptimizerError::State(
                "only the tensors `m` and `v` belong in a state file".into(),
            ));
        }
        Ok(Self { m, v })
    }
}
