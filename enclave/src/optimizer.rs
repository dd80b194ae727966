//! Server optimizers: how the model updater turns a round's noised average update into the next
//! model version (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2; Hsu et
//! al. 2019 for server momentum). Post-processing of a DP release: they spend no privacy, and
//! their state (moments) is kept between rounds as a write-once blob next to each model version.
//!
//! With `Δ` the round's average update, `η` the task's `server_learning_rate` and `x` the model:
//!
//! | optimizer | state update | model update |
//! |---|---|---|
//! | `fedavg` | none | `x += η Δ` |
//! | `fedavgm` | `m = μ m + Δ` | `x += η m` |
//! | `fedadam` | `m = β1 m + (1 - β1) Δ`; `v = β2 v + (1 - β2) Δ²` | `x += η m / (√v + τ)` |
//! | `fedyogi` | `m` as Adam; `v = v - (1 - β2) Δ² sign(v - Δ²)` | `x += η m / (√v + τ)` |
//!
//! Before the first round `m = 0` and `v = τ²` (the paper's `v₋₁ ≥ τ²`); no bias correction
//! (the paper has none). Computed per coordinate in f64, stored as f32: deterministic, so a
//! retried job writes the same bytes.

use confed_worker_api::optimizer::{OptimizerError, OptimizerState, ServerOptimizer};

/// The model updater's step of a server optimizer.
pub trait Step {
    /// One server step: moves `model` (f32 values in schema order) by `average`, updating the
    /// state (`None` before the first round) and returning it (`None` for FedAvg).
    fn step(
        &self,
        model: &mut [f32],
        average: &[f32],
        learning_rate: f64,
        state: Option<OptimizerState>,
    ) -> Result<Option<OptimizerState>, OptimizerError>;
}

impl Step for ServerOptimizer {
    fn step(
        &self,
        model: &mut [f32],
        average: &[f32],
        learning_rate: f64,
        state: Option<OptimizerState>,
    ) -> Result<Option<OptimizerState>, OptimizerError> {
        let n = model.len();
        if average.len() != n {
            return Err(OptimizerError::State(format!(
                "the average has {} values, the model {n}",
                average.len()
            )));
        }
        let moved = |x: &mut f32, by: f64| {
            *x = (f64::from(*x) + learning_rate * by) as f32;
        };
        match *self {
            Self::FedAvg => {
                for (x, d) in model.iter_mut().zip(average) {
                    moved(x, f64::from(*d));
                }
                Ok(None)
            }
            Self::FedAvgM { momentum } => {
                let mut state = state.unwrap_or_else(|| OptimizerState::zeros(n, None));
                state.check(n, false)?;
                for ((x, d), m) in model.iter_mut().zip(average).zip(&mut state.m) {
                    let next = momentum * f64::from(*m) + f64::from(*d);
                    *m = next as f32;
                    moved(x, f64::from(*m));
                }
                state.check(n, false)?;
                Ok(Some(state))
            }
            Self::FedAdam { beta1, beta2, tau } | Self::FedYogi { beta1, beta2, tau } => {
                let yogi = matches!(self, Self::FedYogi { .. });
                let mut state = state.unwrap_or_else(|| OptimizerState::zeros(n, Some(tau * tau)));
                state.check(n, true)?;
                let v = state.v.as_mut().expect("checked: adaptive state has v");
                for (((x, d), m), v) in model.iter_mut().zip(average).zip(&mut state.m).zip(v) {
                    let d = f64::from(*d);
                    let m_next = beta1 * f64::from(*m) + (1.0 - beta1) * d;
                    let v_prev = f64::from(*v);
                    let v_next = if yogi {
                        // sign(v - Δ²) with sign(0) = 0, as the paper (f64::signum(0) is 1).
                        let sign = match v_prev.partial_cmp(&(d * d)) {
                            Some(std::cmp::Ordering::Greater) => 1.0,
                            Some(std::cmp::Ordering::Less) => -1.0,
                            _ => 0.0,
                        };
                        v_prev - (1.0 - beta2) * d * d * sign
                    } else {
                        beta2 * v_prev + (1.0 - beta2) * d * d
                    };
                    *m = m_next as f32;
                    *v = v_next as f32;
                    moved(x, f64::from(*m) / (f64::from(*v).max(0.0).sqrt() + tau));
                }
                state.check(n, true)?;
                Ok(Some(state))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adam() -> ServerOptimizer {
        ServerOptimizer::FedAdam {
            beta1: 0.9,
            beta2: 0.99,
            tau: 1e-3,
        }
    }

    #[test]
    fn fedavg_moves_by_the_learning_rate_and_keeps_no_state() {
        let mut x = [1.0, 2.0];
        let state = ServerOptimizer::FedAvg
            .step(&mut x, &[0.5, -1.0], 0.5, None)
            .unwrap();
        assert_eq!(x, [1.25, 1.5]);
        assert_eq!(state, None);
    }

    #[test]
    fn momentum_accumulates_the_updates() {
        let opt = ServerOptimizer::FedAvgM { momentum: 0.5 };
        let mut x = [0.0f32];
        let s1 = opt.step(&mut x, &[1.0], 1.0, None).unwrap();
        assert_eq!((x[0], s1.as_ref().unwrap().m[0]), (1.0, 1.0));
        let s2 = opt.step(&mut x, &[1.0], 1.0, s1).unwrap();
        // m = 0.5 * 1 + 1 = 1.5; x = 1 + 1.5.
        assert_eq!((x[0], s2.unwrap().m[0]), (2.5, 1.5));
    }

    #[test]
    fn adam_and_yogi_follow_the_paper_by_hand() {
        // One coordinate, Δ = 0.1, η = 1, β1 0.9, β2 0.99, τ 1e-3, v₋₁ = τ².
        let (d, tau) = (0.1f64, 1e-3f64);
        let m = 0.1 * d;
        let v_adam = 0.99 * tau * tau + 0.01 * d * d;
        let v_yogi = tau * tau - 0.01 * d * d * (tau * tau - d * d).signum();
        for (opt, v) in [
            (adam(), v_adam),
            (
                ServerOptimizer::FedYogi {
                    beta1: 0.9,
                    beta2: 0.99,
                    tau,
                },
                v_yogi,
            ),
        ] {
            let mut x = [0.0f32];
            let state = opt.step(&mut x, &[d as f32], 1.0, None).unwrap().unwrap();
            // The moments are stored as f32 and the step uses the stored values.
            let expected = f64::from(m as f32) / (f64::from(v as f32).sqrt() + tau);
            assert!(
                (f64::from(x[0]) - expected).abs() < 1e-6,
                "{opt:?}: {} vs {expected}",
                x[0]
            );
            assert!((f64::from(state.v.unwrap()[0]) - v).abs() < 1e-9, "{opt:?}");
        }
    }

    #[test]
    fn state_files_round_trip_and_wrong_sizes_are_refused() {
        let mut x = [0.0f32; 3];
        let state = adam()
            .step(&mut x, &[0.1, 0.2, 0.3], 1.0, None)
            .unwrap()
            .unwrap();
        let decoded = OptimizerState::decode(&state.encode().unwrap()).unwrap();
        assert_eq!(decoded, state);
        let mut two = [0.0f32; 2];
        assert!(matches!(
            adam().step(&mut two, &[0.1, 0.2], 1.0, Some(decoded)),
            Err(OptimizerError::State(_))
        ));
        let momentum = ServerOptimizer::FedAvgM { momentum: 0.9 };
        assert!(
            momentum
                .step(&mut x, &[0.1, 0.2, 0.3], 1.0, Some(state))
                .is_err()
        );
    }

    #[test]
    fn a_state_that_would_not_be_finite_is_refused_not_stored() {
        // An update near f32's limit squares to infinity in v.
        let mut x = [0.0f32];
        let err = adam().step(&mut x, &[3.0e38], 1.0, None).unwrap_err();
        assert!(matches!(err, OptimizerError::State(_)), "{err}");
        // Yogi's sign of v - Δ² is 0 when they are equal (the paper's sign(0) = 0).
        let yogi = ServerOptimizer::FedYogi {
            beta1: 0.9,
            beta2: 0.99,
            tau: 0.5,
        };
        let mut y = [0.0f32];
        let state = yogi.step(&mut y, &[0.5], 1.0, None).unwrap().unwrap();
        assert_eq!(state.v.unwrap()[0], 0.25, "v = τ² = Δ²: unchanged");
    }

    #[test]
    fn a_state_fits_only_its_optimizer_and_model() {
        let mut x = [0.0f32; 2];
        let adam_state = adam()
            .step(&mut x, &[0.1, 0.2], 1.0, None)
            .unwrap()
            .unwrap();
        assert!(adam_state.fits(&adam(), 2).is_ok());
        assert!(adam_state.fits(&adam(), 3).is_err(), "another model size");
        assert!(
            adam_state
                .fits(&ServerOptimizer::FedAvgM { momentum: 0.9 }, 2)
                .is_err()
        );
        assert!(adam_state.fits(&ServerOptimizer::FedAvg, 2).is_err());
    }

    #[test]
    fn hyperparameters_are_checked_and_defaulted() {
        let parsed: ServerOptimizer = serde_json::from_str(r#"{"name": "fedadam"}"#).unwrap();
        assert_eq!(parsed, adam());
        assert!(
            ServerOptimizer::FedAvgM { momentum: 1.0 }
                .validate()
                .is_err()
        );
        assert!(
            ServerOptimizer::FedYogi {
                beta1: 0.9,
                beta2: 0.99,
                tau: 0.0
            }
            .validate()
            .is_err()
        );
        assert!(serde_json::from_str::<ServerOptimizer>(r#"{"name": "sgd"}"#).is_err());
        assert!(
            serde_json::from_str::<ServerOptimizer>(r#"{"name": "fedavgm", "beta1": 0.9}"#)
                .is_err()
        );
    }
}
