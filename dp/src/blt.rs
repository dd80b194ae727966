//! Buffered linear Toeplitz (BLT) matrices for DP-FTRL (McMahan, Xu and Zhang 2024, "A
//! Hassle-free Algorithm for Private Learning in Practice: Don't Use Tree Aggregation, Use
//! BLTs", arXiv 2408.08868; Dvijotham et al. 2024, arXiv 2404.16706).
//!
//! A BLT with decays `theta_1..d` and output scales `omega_1..d` is the lower-triangular Toeplitz
//! matrix `C` with coefficients `c_0 = 1`, `c_k = sum_j omega_j theta_j^(k-1)` (k >= 1): row `t`
//! of `C x` is `x_t + sum_j omega_j b_j` with one buffer per decay, `b_j <- theta_j b_j + x_t`
//! after each row. Its generating function is `prod_j (1 - thetahat_j z) / prod_j (1 - theta_j
//! z)` for the decays `thetahat` of its inverse, which is a BLT too; so a pair of decay vectors
//! fixes both matrices (`pair_from_decays`, Dvijotham et al. Lemma 5.2).
//!
//! confed's conventions are jax_privacy's (`jax_privacy.matrix_factorization.buffered_toeplitz`,
//! version 2.0.0), so that its optimizer's output and ours can be compared loss for loss: `C` is
//! the strategy (its min-separation sensitivity is what a device can change), `C^-1` the noise
//! correlation, and the workload the prefix sums `A` (the running sum of rounds), with error
//! `B = A C^-1`.
//!
//! - **Sensitivity** under min separation `b` and at most `k` participations: for non-negative,
//!   non-increasing coefficients the worst case is `k` participations exactly `b` apart from the
//!   first round (Kalinin and Lampert 2024, arXiv 2405.13763, Theorem 2), so
//!   `sens^2 = sum_i (sum_{p < k} c_{i - p b})^2`.
//! - **Error** of the released running sum at round `t` (0-based), in noise variances:
//!   `e_t = sum_{s <= t} B_s^2` with `B_s = sum_{r <= s} chat_r` (the prefix sums of `C^-1`'s
//!   coefficients). Max error is `e_{n-1}`; mean error the mean of `e_t`.
//! - **Loss** is error times `sens^2`: the variance at unit privacy cost.

use std::fmt;

pub use confed_protocol::blt_noise::MAX_BLT_BUFFERS as MAX_BUFFERS;

/// Which error of the running sums a BLT is optimized for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The largest variance over the rounds (the last round's).
    Max,
    /// The mean variance over the rounds.
    Mean,
}

/// The arithmetic the loss is written in, so that it can run on plain floats (evaluation) and on
/// dual numbers (its gradient, `blt_optimize`).
pub trait Real:
    Copy
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
{
    fn constant(value: f64) -> Self;
    fn value(&self) -> f64;
    fn ln(self) -> Self;
}

impl Real for f64 {
    fn constant(value: f64) -> Self {
        value
    }
    fn value(&self) -> f64 {
        *self
    }
    fn ln(self) -> Self {
        f64::ln(self)
    }
}

/// A lower-triangular Toeplitz matrix given as a BLT.
#[derive(Debug, Clone, PartialEq)]
pub struct Blt {
    /// `theta`, in decreasing order.
    pub decays: Vec<f64>,
    /// `omega`, in the order of `decays`.
    pub scales: Vec<f64>,
}

impl fmt::Display for Blt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pairs: Vec<String> = self
            .decays
            .iter()
            .zip(&self.scales)
            .map(|(t, w)| format!("{t:e}:{w:e}"))
            .collect();
        write!(f, "[{}]", pairs.join(","))
    }
}

impl Blt {
    /// The identity (no buffers): independent noise on every round.
    pub fn identity() -> Self {
        Self {
            decays: Vec::new(),
            scales: Vec::new(),
        }
    }

    /// A BLT with its buffers sorted by decreasing decay.
    pub fn new(decays: Vec<f64>, scales: Vec<f64>) -> Self {
        let mut pairs: Vec<(f64, f64)> = decays.into_iter().zip(scales).collect();
        pairs.sort_by(|a, b| b.0.total_cmp(&a.0));
        Self {
            decays: pairs.iter().map(|p| p.0).collect(),
            scales: pairs.iter().map(|p| p.1).collect(),
        }
    }

    pub fn buffers(&self) -> usize {
        self.decays.len()
    }

    /// The first `n` Toeplitz coefficients `c_0..c_{n-1}`.
    pub fn coefficients(&self, n: usize) -> Vec<f64> {
        coefficients(&self.decays, &self.scales, n)
    }

    /// Whether this BLT may be a task's strategy matrix (`confed_protocol::blt_noise::check_blt`:
    /// what devices and the enclave check of a policy's BLT).
    pub fn check_strategy(&self) -> Result<(), String> {
        confed_protocol::blt_noise::check_blt(&self.decays, &self.scales)
    }

    /// `C^-1` as a BLT: its decays are the roots of `1 + sum_j omega_j / (lambda - theta_j) = 0`
    /// (the zeros of `C`'s generating function at `z = 1 / lambda`), one in each gap between
    /// consecutive decays and one below the smallest, found by bisection; its scales follow from
    /// the pair. Float arithmetic: the inverse only ever post-processes released values (see
    /// docs/privacy.md, "DP-FTRL with BLT noise"), so its rounding costs accuracy, not privacy.
    pub fn inverse(&self) -> Blt {
        if self.buffers() == 0 {
            return Blt::identity();
        }
        let roots = secular_roots(&self.decays, &self.scales);
        pair_from_decays(&self.decays, &roots).1
    }
}

/// `c_0 = 1`, `c_k = sum_j omega_j theta_j^(k-1)`.
pub fn coefficients<T: Real>(decays: &[T], scales: &[T], n: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    out.push(T::constant(1.0));
    let mut powers: Vec<T> = vec![T::constant(1.0); decays.len()];
    for _ in 1..n {
        let mut c = T::constant(0.0);
        for ((power, scale), decay) in powers.iter_mut().zip(scales).zip(decays) {
            c = c + *scale * *power;
            *power = *power * *decay;
        }
        out.push(c);
    }
    out
}

/// The scales that make `theta` and `theta_hat` the decays of a BLT and of its inverse:
/// `omega_i = prod_j (theta_i - theta_hat_j) / prod_{j != i} (theta_i - theta_j)` (the partial
/// fractions of `prod (1 - theta_hat z) / prod (1 - theta z)`).
pub fn scales_from_decays<T: Real>(theta: &[T], theta_hat: &[T]) -> Vec<T> {
    theta
        .iter()
        .enumerate()
        .map(|(i, &ti)| {
            let mut numerator = T::constant(1.0);
            for &h in theta_hat {
                numerator = numerator * (ti - h);
            }
            let mut denominator = T::constant(1.0);
            for (j, &tj) in theta.iter().enumerate() {
                if j != i {
                    denominator = denominator * (ti - tj);
                }
            }
            numerator / denominator
        })
        .collect()
}

/// (C, C^-1) from their decays.
pub fn pair_from_decays(theta: &[f64], theta_hat: &[f64]) -> (Blt, Blt) {
    (
        Blt::new(theta.to_vec(), scales_from_decays(theta, theta_hat)),
        Blt::new(theta_hat.to_vec(), scales_from_decays(theta_hat, theta)),
    )
}

/// The `d` roots of `f(lambda) = 1 + sum_j w_j / (lambda - t_j)` for distinct `t` and scales
/// `w` of one sign: `f` is monotone between consecutive poles, so each bracket holds one root
/// (positive scales: one below the smallest pole and one between each pair; negative: one
/// between each pair and one above the largest). Bisection to the last bit.
pub fn secular_roots(decays: &[f64], scales: &[f64]) -> Vec<f64> {
    let mut poles: Vec<(f64, f64)> = decays.iter().copied().zip(scales.iter().copied()).collect();
    poles.sort_by(|a, b| a.0.total_cmp(&b.0));
    let f = |x: f64| 1.0 + poles.iter().map(|(t, w)| w / (x - t)).sum::<f64>();
    let positive = poles.iter().all(|p| p.1 > 0.0);
    let span: f64 = 1.0 + poles.iter().map(|p| p.1.abs()).sum::<f64>() * 2.0;
    let mut brackets: Vec<(f64, f64)> = Vec::with_capacity(poles.len());
    if positive {
        brackets.push((poles[0].0 - span, poles[0].0));
    }
    for w in poles.windows(2) {
        brackets.push((w[0].0, w[1].0));
    }
    if !positive {
        let last = poles[poles.len() - 1].0;
        brackets.push((last, last + span));
    }
    brackets
        .into_iter()
        .map(|(lo, hi)| bisect(&f, lo, hi, !positive))
        .collect()
}

/// The root of `f` strictly inside (lo, hi), where `f` is monotone in the direction `rising`
/// (known analytically: every term `w / (x - t)` falls with `x` when `w > 0`, rises when `w < 0`;
/// probing it numerically near a pole can round onto the pole and read the wrong way).
fn bisect(f: &impl Fn(f64) -> f64, mut lo: f64, mut hi: f64, rising: bool) -> f64 {
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if mid <= lo || mid >= hi {
            break;
        }
        let above = f(mid) > 0.0;
        if above == rising {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    0.5 * (lo + hi)
}

/// Rounds of `n` a device can serve under min separation `min_separation` and a cap
/// `max_participations` (`None`: no cap): `min(cap, ceil(n / b))`.
pub fn max_participations(n: u32, min_separation: u32, cap: Option<u32>) -> u32 {
    let most = n.div_ceil(min_separation.max(1));
    cap.map_or(most, |c| c.min(most))
}

/// Squared sensitivity of the Toeplitz matrix with `coefficients` (non-negative and
/// non-increasing) when one device serves at most `participations` rounds, at least
/// `min_separation` apart: the worst case serves rounds 0, b, 2b, ...
pub fn minsep_sensitivity_squared<T: Real>(
    coefficients: &[T],
    min_separation: u32,
    participations: u32,
) -> T {
    // Column i of the worst case is sum_{p < k} c_{i - p b}: a stride-b prefix sum S_i = c_i +
    // S_{i-b}, less the part k strides back, S_{i - k b} (jax_privacy's difference of cumsums):
    // O(n) whatever k.
    let b = min_separation.max(1) as usize;
    let reach = (participations as usize).saturating_mul(b);
    let mut strided: Vec<T> = Vec::with_capacity(coefficients.len());
    let mut total = T::constant(0.0);
    for (i, &c) in coefficients.iter().enumerate() {
        let prefix = if i >= b { c + strided[i - b] } else { c };
        strided.push(prefix);
        let column = if reach > 0 && i >= reach {
            prefix - strided[i - reach]
        } else {
            prefix
        };
        total = total + column * column;
    }
    total
}

/// Variance of the running sum's noise after each round, in noise variances: `e_t = sum_{s <=
/// t} B_s^2`, `B_s` the prefix sums of the noise correlation's coefficients.
pub fn running_sum_variances<T: Real>(inverse_coefficients: &[T]) -> Vec<T> {
    let mut prefix = T::constant(0.0);
    let mut variance = T::constant(0.0);
    inverse_coefficients
        .iter()
        .map(|&c| {
            prefix = prefix + c;
            variance = variance + prefix * prefix;
            variance
        })
        .collect()
}

/// The max or mean of the running-sum variances.
pub fn error<T: Real>(inverse_coefficients: &[T], kind: ErrorKind) -> T {
    let variances = running_sum_variances(inverse_coefficients);
    match kind {
        ErrorKind::Max => *variances.last().unwrap_or(&T::constant(0.0)),
        ErrorKind::Mean => {
            let sum = variances
                .iter()
                .fold(T::constant(0.0), |total, &v| total + v);
            sum / T::constant(variances.len().max(1) as f64)
        }
    }
}

/// What a BLT is optimized and judged for: `n` rounds, one device at most `participations` of
/// them at least `min_separation` apart, and the kind of error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting {
    pub rounds: u32,
    pub min_separation: u32,
    pub participations: u32,
    pub error: ErrorKind,
}

impl Setting {
    /// The setting of `rounds` rounds at min separation `min_separation`, every participation
    /// the separation allows.
    pub fn new(rounds: u32, min_separation: u32, error: ErrorKind) -> Self {
        Self {
            rounds,
            min_separation,
            participations: max_participations(rounds, min_separation, None),
            error,
        }
    }

    /// Error times squared sensitivity of the strategy `blt` (jax_privacy's `LossFn.loss`).
    pub fn loss(&self, blt: &Blt) -> f64 {
        let n = self.rounds as usize;
        let inverse = blt.inverse();
        error(&inverse.coefficients(n), self.error) * self.sensitivity_squared(blt)
    }

    pub fn sensitivity_squared(&self, blt: &Blt) -> f64 {
        minsep_sensitivity_squared(
            &blt.coefficients(self.rounds as usize),
            self.min_separation,
            self.participations,
        )
    }
}

/// jax_privacy's initial BLT for `buffers` buffers (`get_init_blt`: the rational approximation
/// of `1 / sqrt(1 - z)` of Dvijotham et al., Proposition 4.5, with `buf_decay_scale` 1.6 and
/// shift -1, its inverse's decays scaled to at most `1 - 1e-6` and its scales to a Pillutla
/// score of at most `1 - 1e-6`).
pub fn initial(buffers: usize) -> Blt {
    if buffers == 0 {
        return Blt::identity();
    }
    let d1 = buffers.div_ceil(2) as f64;
    let step = 1.6 * std::f64::consts::PI / (2.0 * (d1 + 1.0)).sqrt();
    let ks: Vec<f64> = (0..buffers).map(|i| -d1 + 1.0 + i as f64 - 1.0).collect();
    let inverse_decays: Vec<f64> = ks
        .iter()
        .map(|k| 1.0 / (1.0 + (2.0 * step * k).exp()))
        .collect();
    let constant: f64 = ks
        .iter()
        .zip(&inverse_decays)
        .map(|(k, c)| (step * k).exp() * c)
        .sum();
    let inverse_scales: Vec<f64> = ks
        .iter()
        .zip(&inverse_decays)
        .map(|(k, c)| -(c * c) * (3.0 * step * k).exp() / constant)
        .collect();
    let decays = secular_roots(&inverse_decays, &inverse_scales);
    let scales = scales_from_decays(&decays, &inverse_decays);
    let blt = Blt::new(decays, scales);
    let cap = 1.0 - 1e-6;
    let shrink = (cap / blt.decays[0]).min(1.0);
    let decays: Vec<f64> = blt.decays.iter().map(|t| t * shrink).collect();
    let score: f64 = blt.scales.iter().zip(&decays).map(|(w, t)| w / t).sum();
    let scale_down = (cap / score).min(1.0);
    Blt::new(decays, blt.scales.iter().map(|w| w * scale_down).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dense lower-triangular inverse of Toeplitz coefficients, by forward substitution.
    fn inverse_coefficients(c: &[f64]) -> Vec<f64> {
        let mut out = vec![0.0; c.len()];
        for k in 0..c.len() {
            let mut v = if k == 0 { 1.0 } else { 0.0 };
            for j in 1..=k {
                v -= c[j] * out[k - j];
            }
            out[k] = v / c[0];
        }
        out
    }

    #[test]
    fn the_inverse_of_a_blt_is_the_blt_of_its_inverse_coefficients() {
        let blt = Blt::new(vec![0.98, 0.6], vec![0.24, 0.27]);
        blt.check_strategy().unwrap();
        let inverse = blt.inverse();
        assert_eq!(inverse.buffers(), 2);
        assert!(inverse.decays.iter().all(|t| *t > 0.0 && *t < 1.0));
        assert!(inverse.scales.iter().all(|w| *w < 0.0));
        let dense = inverse_coefficients(&blt.coefficients(300));
        for (k, (a, b)) in dense.iter().zip(inverse.coefficients(300)).enumerate() {
            assert!((a - b).abs() < 1e-12, "{k}: {a} {b}");
        }
    }

    #[test]
    fn min_separation_sensitivity_adds_columns_b_apart() {
        // c = 1, 0.5, 0.25, 0.125; b = 2, k = 2: columns 0 and 2 -> v = 1, .5, 1.25, .625.
        let c = [1.0, 0.5, 0.25, 0.125];
        let s: f64 = minsep_sensitivity_squared(&c, 2, 2);
        assert!((s - (1.0 + 0.25 + 1.5625 + 0.390625)).abs() < 1e-15);
        // One participation: the column norm.
        let one: f64 = minsep_sensitivity_squared(&c, 2, 1);
        assert!((one - (1.0 + 0.25 + 0.0625 + 0.015625)).abs() < 1e-15);
        // Against the direct sum, on a longer matrix and several caps.
        let long = Blt::new(vec![0.97, 0.5], vec![0.3, 0.2]).coefficients(300);
        for (b, k) in [(1u32, 300u32), (7, 3), (10, 30), (300, 1)] {
            let direct: f64 = (0..300)
                .map(|i: usize| {
                    (0..k as usize)
                        .filter_map(|p| i.checked_sub(p * b as usize))
                        .map(|j| long[j])
                        .sum::<f64>()
                        .powi(2)
                })
                .sum();
            let fast: f64 = minsep_sensitivity_squared(&long, b, k);
            assert!((fast - direct).abs() < 1e-9 * direct, "{b} {k}");
        }
        assert_eq!(max_participations(2000, 100, None), 20);
        assert_eq!(max_participations(2000, 2000, None), 1);
        assert_eq!(max_participations(10, 3, Some(2)), 2);
    }

    #[test]
    fn the_identity_is_independent_noise_and_costs_every_participation() {
        let setting = Setting::new(100, 10, ErrorKind::Max);
        let identity = Blt::identity();
        // Running sum of 100 independent noises: variance 100; 10 participations.
        assert!((setting.loss(&identity) - 1000.0).abs() < 1e-9);
        let mean = Setting {
            error: ErrorKind::Mean,
            ..setting
        };
        assert!((mean.loss(&identity) - 50.5 * 10.0).abs() < 1e-9);
    }

    #[test]
    fn strategy_checks_name_what_is_wrong() {
        let cases = [
            (Blt::new(vec![1.0], vec![0.5]), "decay must be in (0, 1)"),
            (Blt::new(vec![0.5], vec![-0.1]), "scale must be positive"),
            (Blt::new(vec![0.9, 0.5], vec![0.6, 0.5]), "at most 1"),
            (Blt::new(vec![0.2], vec![0.3]), "below 1"),
            (Blt::new(vec![0.5, 0.5 - 1e-12], vec![0.1, 0.1]), "apart"),
        ];
        for (blt, says) in cases {
            let err = blt.check_strategy().unwrap_err();
            assert!(err.contains(says), "{err}");
        }
    }

    #[test]
    fn the_initial_blt_is_a_valid_strategy_for_every_buffer_count() {
        for buffers in 1..=MAX_BUFFERS {
            let blt = initial(buffers);
            assert_eq!(blt.buffers(), buffers);
            blt.check_strategy()
                .unwrap_or_else(|e| panic!("{buffers}: {e}: {blt}"));
        }
    }
}
