//! OpenDP's privacy maps of the grid mechanism: the accountant the enclave calibrates its noise
//! and records each release's cost with (`confed_dp` composes them).

use opendp::combinators::{make_fix_delta, make_zCDP_to_approxDP};
use opendp::domains::AtomDomain;
use opendp::measurements::make_gaussian;
use opendp::measures::ZeroConcentratedDivergence;
use opendp::metrics::AbsoluteDistance;

use confed_dp::grid::GRID_UNITS_PER_CLIP;
use confed_dp::{Accountant, DpError};

/// OpenDP 0.16's discrete Gaussian under zCDP and its zCDP -> approximate-DP cast.
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenDp;

impl Accountant for OpenDp {
    fn name(&self) -> &'static str {
        "OpenDP"
    }

    fn rho_at(&self, scale_grid: f64) -> Result<f64, DpError> {
        make_gaussian::<_, _, ZeroConcentratedDivergence>(
            AtomDomain::<i64>::default(),
            AbsoluteDistance::<i64>::default(),
            scale_grid,
            None,
        )
        .and_then(|m| m.map(&GRID_UNITS_PER_CLIP))
        .map_err(opendp_error)
    }

    fn epsilon_at(&self, scale_grid: f64, delta: f64) -> Result<f64, DpError> {
        let gaussian = make_gaussian::<_, _, ZeroConcentratedDivergence>(
            AtomDomain::<i64>::default(),
            AbsoluteDistance::<i64>::default(),
            scale_grid,
            None,
        )
        .map_err(opendp_error)?;
        let approx = make_fix_delta(
            &make_zCDP_to_approxDP(gaussian).map_err(opendp_error)?,
            delta,
        )
        .map_err(opendp_error)?;
        let (epsilon, _) = approx.map(&GRID_UNITS_PER_CLIP).map_err(opendp_error)?;
        Ok(epsilon)
    }
}

fn opendp_error(e: opendp::error::Error) -> DpError {
    DpError::Accountant {
        accountant: "OpenDP",
        reason: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use confed_dp::grid::GRID_UNITS_PER_CLIP;
    use confed_dp::{ClosedForm, DpError, calibrate, check_plan, spent};
    use confed_protocol::policy::{DpMechanism, Mechanism};

    #[test]
    fn one_round_epsilon_one_matches_opendp_python_reference() {
        // OpenDP's Python package: scale 4.530877 for epsilon 1, delta 1e-6, sensitivity 1.
        let c = calibrate(&OpenDp, 1.0, 1e-6, 1).unwrap();
        assert!((c.noise_multiplier - 4.5309).abs() < 1e-3, "{c:?}");
    }

    #[test]
    fn more_rounds_need_sqrt_more_noise_per_round() {
        let one = calibrate(&OpenDp, 2.0, 1e-6, 1).unwrap();
        let many = calibrate(&OpenDp, 2.0, 1e-6, 16).unwrap();
        assert!((many.noise_multiplier / one.noise_multiplier - 4.0).abs() < 1e-6);
        assert!((many.rho_per_round * 16.0 - one.rho_per_round).abs() < 1e-9);
    }

    #[test]
    fn spending_every_planned_round_stays_within_the_budget() {
        let c = calibrate(&OpenDp, 3.0, 1e-5, 10).unwrap();
        let scale = c.noise_multiplier * GRID_UNITS_PER_CLIP as f64;
        let (_, eps_half) = spent(&OpenDp, scale, 5, 1e-5).unwrap();
        let (_, eps_all) = spent(&OpenDp, scale, 10, 1e-5).unwrap();
        assert!(eps_half < eps_all);
        assert!(eps_all <= 3.0 && eps_all > 2.99, "{eps_all}");
    }

    #[test]
    fn the_closed_forms_shortcut_leaves_the_search_exactly_opendps() {
        // The search with the shortcut must land on OpenDP's own bisection's scale bit for bit
        // (a retried round's noise is a function of it), over budgets a task may have.
        for epsilon in [0.05, 0.5, 1.0, 4.0, 8.0, 50.0] {
            for delta in [1e-10, 1e-6, 1e-3] {
                let quick = confed_dp::search_scale(&OpenDp, epsilon, delta, true);
                let full = confed_dp::search_scale(&OpenDp, epsilon, delta, false);
                assert_eq!(
                    quick.map(f64::to_bits),
                    full.map(f64::to_bits),
                    "epsilon {epsilon}, delta {delta}"
                );
            }
        }
    }

    #[test]
    fn invalid_budgets_are_refused() {
        assert!(matches!(
            calibrate(&OpenDp, 0.0, 1e-6, 1),
            Err(DpError::InvalidBudget(_))
        ));
        assert!(matches!(
            calibrate(&OpenDp, 1.0, 0.0, 1),
            Err(DpError::InvalidBudget(_))
        ));
        assert!(matches!(
            calibrate(&OpenDp, 1.0, 1e-6, 0),
            Err(DpError::InvalidBudget(_))
        ));
    }

    #[test]
    fn the_front_ends_closed_form_agrees_with_opendp_to_1e_9() {
        // The front end refuses plans with `ClosedForm`; the enclave calibrates with OpenDP. They
        // must agree on every map, or a plan accepted at creation could be calibrated otherwise.
        // From epsilon 100's scale (about 0.06) to the sampler's limit, and every delta the API
        // takes (up to 0.01).
        for multiplier in [
            0.05, 0.1, 0.3, 0.5, 1.0, 2.0, 4.53, 10.0, 50.0, 300.0, 2000.0, 16000.0,
        ] {
            let scale = multiplier * GRID_UNITS_PER_CLIP as f64;
            let (rho, reference) = (
                ClosedForm.rho_at(scale).unwrap(),
                OpenDp.rho_at(scale).unwrap(),
            );
            assert!(
                (rho / reference - 1.0).abs() < 1e-9,
                "rho at {multiplier}: {rho} vs {reference}"
            );
            for delta in [1e-2, 1e-3, 1e-5, 1e-6, 1e-8, 1e-10] {
                let ours = ClosedForm.epsilon_at(scale, delta).unwrap();
                let reference = OpenDp.epsilon_at(scale, delta).unwrap();
                assert!(
                    (ours - reference).abs() <= 1e-9 * reference.max(1e-3),
                    "epsilon at {multiplier}, {delta}: {ours} vs {reference}"
                );
            }
        }
    }

    #[test]
    fn plans_are_accepted_and_calibrated_alike_by_both_accountants() {
        let mechanisms = [
            DpMechanism::plain(Mechanism::Gaussian),
            DpMechanism::plain(Mechanism::Tree { min_separation: 4 }),
        ];
        for mechanism in mechanisms {
            let plans = [
                (1.0, 1e-6, 10, 5),
                (1.0, 1e-6, 10, 15),
                (4.0, 1e-6, 100, 50),
                (8.0, 1e-2, 3, 2),
                (100.0, 1e-2, 1, 1),
                (0.01, 1e-10, 1000, 1_000_000),
            ];
            for (epsilon, delta, rounds, goal) in plans {
                let ours = check_plan(&ClosedForm, mechanism, epsilon, delta, rounds, goal);
                let reference = check_plan(&OpenDp, mechanism, epsilon, delta, rounds, goal);
                assert_eq!(
                    ours.is_ok(),
                    reference.is_ok(),
                    "{mechanism:?} {epsilon} {rounds} {goal}"
                );
                if let (Ok(ours), Ok(reference)) = (ours, reference) {
                    let ratio = ours.noise_multiplier / reference.noise_multiplier;
                    assert!((ratio - 1.0).abs() < 1e-9, "{ratio}");
                }
            }
        }
    }
}
