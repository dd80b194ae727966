//! The BLT a task gets: optimized for its rounds, min separation and participations the way
//! jax_privacy 2.0.0's `buffered_toeplitz.optimize` does, so that the two agree on the loss
//! (tests/privacy/test_blt.py holds ours within 1 % of jax_privacy's at the settings the issue
//! names).
//!
//! The same problem as jax_privacy's: the parameters are the decays of `C` and of `C^-1`
//! (its `buf_decay_pair` parameterization), the objective the loss (`Setting::loss`) divided by
//! `k + (1 + ln(n) / pi)^2` (its rough optimum, so that the barriers weigh the same at every
//! size) plus `1e-8` times log barriers that keep the pair valid (decays in (0, 1), `C`'s scales
//! positive and `C^-1`'s negative, decays apart, scales summing below 1, Pillutla score below
//! 1), started from its rational approximation (`blt::initial`), and the number of buffers grows
//! from 0 while one more buffer lowers the loss by more than 1 % (with a patience of two counts,
//! `PATIENCE`).
//!
//! The minimizer is our own L-BFGS (memory 15, steps at most 1, strong-Wolfe line search by
//! bisection) rather than a crate's: a barrier objective is infinite or NaN outside the valid
//! set, which the line search must treat as "too far" (argmin's More-Thuente search expects a
//! finite objective everywhere), and the gradient comes exactly from forward-mode dual numbers
//! through the same generic loss code that evaluates it, not from finite differences.

use super::blt::{
    Blt, ErrorKind, MAX_BUFFERS, Real, Setting, coefficients, error, initial,
    minsep_sensitivity_squared, scales_from_decays,
};

/// L-BFGS iterations per buffer count, at most (jax_privacy's `max_optimizer_steps`).
const MAX_STEPS: usize = 600;
/// Curvature pairs kept (jax_privacy's `memory_size`).
const MEMORY: usize = 15;
/// Weight of the barriers (jax_privacy's `penalty_strength`).
const PENALTY: f64 = 1e-8;
/// Smallest gap the decay barrier allows (jax_privacy's `min_theta_gap`).
const MIN_GAP: f64 = 1e-12;
/// Relative improvement one more buffer must bring (jax_privacy's `rtol`).
const MORE_BUFFERS_RTOL: f64 = 1.01;
/// Buffer counts tried past the last one that improved. jax_privacy stops at the first that
/// does not (patience 1); a local optimum where one buffer's scale collapses to ~0 (seen at 2
/// buffers for 1024 rounds, min separation 64, mean error) would then hide the better optimum
/// one count further.
const PATIENCE: usize = 2;

/// A number with its gradient with respect to `N` parameters.
#[derive(Debug, Clone, Copy)]
struct Dual<const N: usize> {
    value: f64,
    gradient: [f64; N],
}

impl<const N: usize> Dual<N> {
    fn variable(value: f64, index: usize) -> Self {
        let mut gradient = [0.0; N];
        gradient[index] = 1.0;
        Self { value, gradient }
    }

    fn map(self, value: f64, derivative: f64) -> Self {
        Self {
            value,
            gradient: self.gradient.map(|g| g * derivative),
        }
    }
}

impl<const N: usize> std::ops::Add for Dual<N> {
    type Output = Self;
    fn add(mut self, other: Self) -> Self {
        self.value += other.value;
        for (a, b) in self.gradient.iter_mut().zip(other.gradient) {
            *a += b;
        }
        self
    }
}

impl<const N: usize> std::ops::Sub for Dual<N> {
    type Output = Self;
    fn sub(mut self, other: Self) -> Self {
        self.value -= other.value;
        for (a, b) in self.gradient.iter_mut().zip(other.gradient) {
            *a -= b;
        }
        self
    }
}

impl<const N: usize> std::ops::Mul for Dual<N> {
    type Output = Self;
    fn mul(self, other: Self) -> Self {
        let mut gradient = [0.0; N];
        for (i, g) in gradient.iter_mut().enumerate() {
            *g = self.gradient[i] * other.value + other.gradient[i] * self.value;
        }
        Self {
            value: self.value * other.value,
            gradient,
        }
    }
}

impl<const N: usize> std::ops::Div for Dual<N> {
    type Output = Self;
    fn div(self, other: Self) -> Self {
        let value = self.value / other.value;
        let mut gradient = [0.0; N];
        for (i, g) in gradient.iter_mut().enumerate() {
            *g = (self.gradient[i] - value * other.gradient[i]) / other.value;
        }
        Self { value, gradient }
    }
}

impl<const N: usize> std::ops::Neg for Dual<N> {
    type Output = Self;
    fn neg(self) -> Self {
        self.map(-self.value, -1.0)
    }
}

impl<const N: usize> Real for Dual<N> {
    fn constant(value: f64) -> Self {
        Self {
            value,
            gradient: [0.0; N],
        }
    }
    fn value(&self) -> f64 {
        self.value
    }
    fn ln(self) -> Self {
        self.map(self.value.ln(), 1.0 / self.value)
    }
}

/// `-sum ln(x)`: infinite or NaN unless every `x` is positive.
fn barrier<T: Real>(values: impl IntoIterator<Item = T>) -> T {
    values
        .into_iter()
        .fold(T::constant(0.0), |total, x| total - x.ln())
}

/// The smallest distance between two of `values` (as a differentiable expression).
fn min_gap<T: Real>(values: &[T]) -> T {
    let mut best: Option<(f64, T)> = None;
    for i in 0..values.len() {
        for j in i + 1..values.len() {
            let difference = values[i] - values[j];
            let gap = if difference.value() >= 0.0 {
                difference
            } else {
                -difference
            };
            if best.is_none_or(|(b, _)| gap.value() < b) {
                best = Some((gap.value(), gap));
            }
        }
    }
    best.map_or(T::constant(f64::INFINITY), |(_, gap)| gap)
}

/// The objective at the decays of `C` (`params[..d]`) and of `C^-1` (`params[d..]`).
fn objective<T: Real>(params: &[T], setting: &Setting) -> T {
    let d = params.len() / 2;
    let (theta, theta_hat) = params.split_at(d);
    let omega = scales_from_decays(theta, theta_hat);
    let omega_hat = scales_from_decays(theta_hat, theta);
    let n = setting.rounds as usize;
    let strategy = coefficients(theta, &omega, n);
    let noising = coefficients(theta_hat, &omega_hat, n);
    let loss = error(&noising, setting.error)
        * minsep_sensitivity_squared(&strategy, setting.min_separation, setting.participations);
    let rough_optimum =
        f64::from(setting.participations) + (1.0 + (n as f64).ln() / std::f64::consts::PI).powi(2);
    let one = T::constant(1.0);
    let mut penalty = barrier(theta.iter().copied())
        + barrier(theta.iter().map(|&t| one - t))
        + barrier(omega.iter().copied())
        + barrier(theta_hat.iter().copied())
        + barrier(theta_hat.iter().map(|&t| one - t))
        + barrier(omega_hat.iter().map(|&w| -w));
    if d > 1 {
        let gap = T::constant(MIN_GAP);
        penalty = penalty + barrier([min_gap(theta) - gap]) + barrier([min_gap(theta_hat) - gap]);
    }
    let second = omega.iter().fold(T::constant(0.0), |s, &w| s + w);
    let score = omega
        .iter()
        .zip(theta)
        .fold(T::constant(0.0), |s, (&w, &t)| s + w / t);
    penalty = penalty + barrier([one - second]) + barrier([one - score]);
    loss / T::constant(rough_optimum) + penalty * T::constant(PENALTY)
}

/// An objective: its value and gradient at a point (non-finite outside its domain).
type Objective<'a> = &'a dyn Fn(&[f64]) -> (f64, Vec<f64>);

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Minimizes `f` (value and gradient; non-finite outside its domain) from `x` by L-BFGS.
fn lbfgs(f: Objective<'_>, mut x: Vec<f64>) -> Vec<f64> {
    let (mut value, mut gradient) = f(&x);
    if !value.is_finite() {
        return x;
    }
    let mut history: Vec<(Vec<f64>, Vec<f64>, f64)> = Vec::new(); // (s, y, 1 / y.s)
    let mut stalled = 0;
    for _ in 0..MAX_STEPS {
        // Two-loop recursion: direction = -H gradient.
        let mut q = gradient.clone();
        let mut alphas = Vec::with_capacity(history.len());
        for (s, y, rho) in history.iter().rev() {
            let a = rho * dot(s, &q);
            q.iter_mut().zip(y).for_each(|(qi, yi)| *qi -= a * yi);
            alphas.push(a);
        }
        if let Some((s, y, _)) = history.last() {
            let gamma = dot(s, y) / dot(y, y);
            q.iter_mut().for_each(|qi| *qi *= gamma);
        } else {
            // First step: a steepest-descent step of length at most 1e-3 per unit gradient.
            let norm = dot(&gradient, &gradient).sqrt();
            let scale = (1e-3 / norm).min(1.0);
            q.iter_mut().for_each(|qi| *qi *= scale);
        }
        for ((s, y, rho), a) in history.iter().zip(alphas.iter().rev()) {
            let b = rho * dot(y, &q);
            q.iter_mut().zip(s).for_each(|(qi, si)| *qi += (a - b) * si);
        }
        let mut direction: Vec<f64> = q.iter().map(|v| -v).collect();
        if dot(&direction, &gradient) >= 0.0 {
            history.clear();
            direction = gradient.iter().map(|g| -g * 1e-3).collect();
        }
        let Some((step, next_value, next_gradient)) =
            line_search(f, &x, &direction, value, dot(&gradient, &direction))
        else {
            if history.is_empty() {
                break;
            }
            history.clear();
            continue;
        };
        let s: Vec<f64> = direction.iter().map(|d| d * step).collect();
        let y: Vec<f64> = next_gradient
            .iter()
            .zip(&gradient)
            .map(|(a, b)| a - b)
            .collect();
        x.iter_mut().zip(&s).for_each(|(xi, si)| *xi += si);
        let improvement = value - next_value;
        value = next_value;
        gradient = next_gradient;
        let curvature = dot(&s, &y);
        if curvature > 1e-300 {
            if history.len() == MEMORY {
                history.remove(0);
            }
            history.push((s, y, 1.0 / curvature));
        }
        stalled = if improvement <= 1e-15 * value.abs() {
            stalled + 1
        } else {
            0
        };
        if stalled >= 10 {
            break;
        }
    }
    x
}

/// A step along `direction` meeting the strong Wolfe conditions (c1 = 1e-4, c2 = 0.9), at
/// most 1, by expansion then bisection; a non-finite value counts as too long a step.
fn line_search(
    f: Objective<'_>,
    x: &[f64],
    direction: &[f64],
    value: f64,
    slope: f64,
) -> Option<(f64, f64, Vec<f64>)> {
    const C1: f64 = 1e-4;
    const C2: f64 = 0.9;
    let at = |step: f64| {
        let point: Vec<f64> = x.iter().zip(direction).map(|(a, d)| a + step * d).collect();
        let (v, g) = f(&point);
        let s = dot(&g, direction);
        (v, g, s)
    };
    let sufficient = |step: f64, v: f64| v.is_finite() && v <= value + C1 * step * slope;
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    let mut best: Option<(f64, f64, Vec<f64>)> = None;
    for probe in 0..200 {
        let step = if probe == 0 { hi } else { 0.5 * (lo + hi) };
        if step <= 0.0 || (hi - lo) < 1e-20 * hi.max(1e-300) {
            break;
        }
        let (v, g, s) = at(step);
        if !sufficient(step, v) {
            hi = step;
            continue;
        }
        if s.abs() <= -C2 * slope {
            return Some((step, v, g));
        }
        best = Some((step, v, g));
        if s < 0.0 {
            if step >= 1.0 {
                break;
            }
            lo = step;
        } else {
            hi = step;
        }
    }
    best
}

/// The best BLT with exactly `buffers` buffers from jax_privacy's start, and its loss (infinite
/// when the optimization leaves the valid set).
pub fn optimize_buffers(setting: &Setting, buffers: usize) -> (Blt, f64) {
    match buffers {
        0 => {
            let identity = Blt::identity();
            let loss = setting.loss(&identity);
            (identity, loss)
        }
        1 => run::<2>(setting, 1),
        2 => run::<4>(setting, 2),
        3 => run::<6>(setting, 3),
        4 => run::<8>(setting, 4),
        5 => run::<10>(setting, 5),
        6 => run::<12>(setting, 6),
        7 => run::<14>(setting, 7),
        8 => run::<16>(setting, 8),
        9 => run::<18>(setting, 9),
        _ => run::<20>(setting, buffers.min(MAX_BUFFERS)),
    }
}

fn run<const N: usize>(setting: &Setting, buffers: usize) -> (Blt, f64) {
    let start = initial(buffers);
    let mut x = start.decays.clone();
    x.extend(start.inverse().decays);
    let f = |point: &[f64]| {
        let duals: Vec<Dual<N>> = point
            .iter()
            .enumerate()
            .map(|(i, &v)| Dual::variable(v, i))
            .collect();
        let out = objective(&duals, setting);
        (out.value, out.gradient.to_vec())
    };
    let x = lbfgs(&f, x);
    let (theta, theta_hat) = x.split_at(buffers);
    let blt = Blt::new(theta.to_vec(), scales_from_decays(theta, theta_hat));
    if blt.check_strategy().is_err() {
        return (blt, f64::INFINITY);
    }
    let loss = setting.loss(&blt);
    (
        blt,
        if loss.is_finite() {
            loss
        } else {
            f64::INFINITY
        },
    )
}

/// The BLT for `setting`: buffers from 0 up while one more (or, see `PATIENCE`, two more) lowers
/// the loss by over 1 % (jax_privacy's `optimize` with its defaults), with its loss.
pub fn optimize(setting: &Setting) -> (Blt, f64) {
    let (mut best, mut best_loss) = optimize_buffers(setting, 0);
    let mut without_gain = 0;
    for buffers in 1..=MAX_BUFFERS {
        let (blt, loss) = optimize_buffers(setting, buffers);
        if MORE_BUFFERS_RTOL * loss < best_loss {
            best = blt;
            best_loss = loss;
            without_gain = 0;
        } else {
            without_gain += 1;
            if without_gain == PATIENCE {
                break;
            }
        }
    }
    (best, best_loss)
}

/// `optimize` for the max or mean error of `rounds` rounds at `min_separation`.
pub fn optimize_for(rounds: u32, min_separation: u32, error: ErrorKind) -> (Blt, f64) {
    optimize(&Setting::new(rounds, min_separation, error))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dual_gradients_match_finite_differences() {
        let setting = Setting::new(200, 20, ErrorKind::Mean);
        let start = initial(3);
        let mut x = start.decays.clone();
        x.extend(start.inverse().decays);
        let duals: Vec<Dual<6>> = x
            .iter()
            .enumerate()
            .map(|(i, &v)| Dual::variable(v, i))
            .collect();
        let exact = objective(&duals, &setting);
        for i in 0..6 {
            let h = 1e-7 * x[i];
            let mut up = x.clone();
            up[i] += h;
            let mut down = x.clone();
            down[i] -= h;
            let numeric = (objective(&up, &setting) - objective(&down, &setting)) / (2.0 * h);
            let analytic = exact.gradient[i];
            assert!(
                (numeric - analytic).abs() <= 1e-5 * analytic.abs().max(1e-6),
                "{i}: {numeric} {analytic}"
            );
        }
    }

    #[test]
    fn an_optimized_blt_beats_independent_noise_and_is_a_valid_strategy() {
        let setting = Setting::new(256, 16, ErrorKind::Max);
        let (_, identity) = optimize_buffers(&setting, 0);
        let (blt, loss) = optimize(&setting);
        blt.check_strategy().unwrap();
        assert!(blt.buffers() >= 1, "{blt}");
        assert!(loss < identity / 3.0, "{loss} vs {identity}");
    }
}
