//! The BLT noise a task policy names (`Mechanism::Blt`): DP-FTRL with buffered linear Toeplitz
//! correlated noise (McMahan, Xu and Zhang 2024, arXiv 2408.08868).
//!
//! ```text
//! blt_on_grid;min_separation=<b>;buffers=<theta>:<omega>,...;max_values=<D>;lattice_bits=<m>
//! ```
//!
//! - `buffers`: the strategy matrix `C` as a BLT, 0 to `MAX_BLT_BUFFERS` pairs of decay
//!   `theta` and scale `omega` (`c_0 = 1`, `c_k = sum omega theta^(k-1)`), decays in decreasing
//!   order. Each number is a multiple of 2^-52 written in the policy's `{:e}` form, so that the
//!   enclave's fixed-point arithmetic uses exactly the matrix the accounting charges for.
//! - `max_values`: the most model values a release may noise. The enclave rounds `C`'s running
//!   part to its noise lattice once per value and round, and the accounting charges that
//!   rounding for this many values (docs/privacy.md, "DP-FTRL with BLT noise").
//! - `lattice_bits`: the noise lattice is `2^m` grid units finer than the sum's grid.
//!
//! A device serves rounds at least `b` apart, as under tree aggregation, so at most
//! `ceil(rounds / b)` of them.

/// The policy's name of BLT noise.
pub const BLT_MECHANISM: &str = "blt_on_grid";
/// Most buffers (jax_privacy's `optimize` searches up to 10).
pub const MAX_BLT_BUFFERS: usize = 10;
/// Smallest gap between two decays: closer ones make the inverse ill-conditioned.
pub const MIN_BLT_DECAY_GAP: f64 = 1e-9;
/// Most rounds of a BLT task (the enclave's policy check): the accounting's allowance for the
/// fixed point's error is sized for them.
pub const MAX_BLT_ROUNDS: u32 = 10_000;
/// Longest minimum separation: the most rounds.
pub const MAX_BLT_MIN_SEPARATION: u32 = MAX_BLT_ROUNDS;
/// Largest `max_values` (2^32 values: 16 GiB of f32).
pub const MAX_BLT_VALUES: u64 = 1 << 32;
/// `max_values` when a task does not say (2^24 values: a 64 MiB model).
pub const DEFAULT_BLT_MAX_VALUES: u64 = 1 << 24;
/// Finest noise lattice, in bits below the grid (the sampler's range, 2^30 units, bounds it
/// anyway).
pub const MAX_LATTICE_BITS: u32 = 14;
/// Numbers of a BLT are multiples of this (2^-52).
pub const BLT_QUANTUM: f64 = 1.0 / (1u64 << 52) as f64;

/// A BLT noise configuration. Decays and scales are kept as their bits, so the type is `Eq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BltNoise {
    pub min_separation: u32,
    pub max_values: u64,
    pub lattice_bits: u32,
    buffers: u8,
    decays: [u64; MAX_BLT_BUFFERS],
    scales: [u64; MAX_BLT_BUFFERS],
}

/// `x` rounded to the nearest multiple of 2^-52 (the BLT's fixed point).
pub fn quantize(x: f64) -> f64 {
    (x / BLT_QUANTUM).round() * BLT_QUANTUM
}

/// Whether decays and scales make a valid strategy matrix: 0 to `MAX_BLT_BUFFERS` pairs, decays
/// in (0, 1), decreasing and at least `MIN_BLT_DECAY_GAP` apart, positive scales summing to at
/// most 1 (then every coefficient is positive and none exceeds the one before, which the
/// min-separation sensitivity needs), and `sum omega / theta < 1` (then the inverse's decays are
/// in (0, 1) and its scales negative: McMahan, Rush and Xu 2025, arXiv 2504.21413, Theorem 1).
pub fn check_blt(decays: &[f64], scales: &[f64]) -> Result<(), String> {
    let d = decays.len();
    if d > MAX_BLT_BUFFERS || scales.len() != d {
        return Err(format!(
            "a BLT has 0 to {MAX_BLT_BUFFERS} buffers, each a decay and a scale (got {d} decays, {} scales)",
            scales.len()
        ));
    }
    if let Some(bad) = decays.iter().find(|t| !(**t > 0.0 && **t < 1.0)) {
        return Err(format!("every BLT decay must be in (0, 1) (got {bad:e})"));
    }
    if let Some(bad) = scales.iter().find(|w| !(**w > 0.0 && w.is_finite())) {
        return Err(format!("every BLT scale must be positive (got {bad:e})"));
    }
    if decays.windows(2).any(|w| w[0] - w[1] < MIN_BLT_DECAY_GAP) {
        return Err(format!(
            "BLT decays must be in decreasing order and at least {MIN_BLT_DECAY_GAP:e} apart"
        ));
    }
    let second: f64 = scales.iter().sum();
    if second > 1.0 {
        return Err(format!(
            "the BLT scales sum to {second:e}: at most 1, so that the coefficients do not increase"
        ));
    }
    let score: f64 = scales.iter().zip(decays).map(|(w, t)| w / t).sum();
    if score >= 1.0 {
        return Err(format!(
            "sum of scale / decay is {score:e}: below 1, so that the inverse's decays are in (0, 1)"
        ));
    }
    Ok(())
}

/// `<theta>:<omega>,...` as (decays, scales), each a finite number (the empty text: no
/// buffers). Whether they make a valid BLT is `BltNoise::new`'s to say.
pub fn parse_buffer_pairs(text: &str) -> Result<(Vec<f64>, Vec<f64>), String> {
    let mut decays = Vec::new();
    let mut scales = Vec::new();
    if text.is_empty() {
        return Ok((decays, scales));
    }
    for pair in text.split(',') {
        let number = |x: &str| x.parse::<f64>().ok().filter(|x| x.is_finite());
        let (t, w) = pair
            .split_once(':')
            .and_then(|(t, w)| Some((number(t)?, number(w)?)))
            .ok_or_else(|| format!("{pair:?} is not <theta>:<omega> (two finite numbers)"))?;
        decays.push(t);
        scales.push(w);
    }
    Ok((decays, scales))
}

/// Whether a task of `rounds` rounds at `min_separation` may run BLT noise: 1 to
/// `MAX_BLT_ROUNDS` rounds (the fixed point's allowance is valid that far), a separation in
/// 1..=`MAX_BLT_MIN_SEPARATION`.
pub fn check_shape(rounds: u32, min_separation: u32) -> Result<(), String> {
    if !(1..=MAX_BLT_ROUNDS).contains(&rounds) {
        return Err(format!(
            "BLT noise runs 1 to {MAX_BLT_ROUNDS} rounds (got {rounds})"
        ));
    }
    check_min_separation(min_separation)
}

fn check_min_separation(min_separation: u32) -> Result<(), String> {
    if !(1..=MAX_BLT_MIN_SEPARATION).contains(&min_separation) {
        return Err(format!(
            "min_separation {min_separation} (must be in 1..={MAX_BLT_MIN_SEPARATION})"
        ));
    }
    Ok(())
}

impl BltNoise {
    /// A configuration from its parts, checked (`check_blt`, numbers on the 2^-52 grid, the
    /// ranges of the rest).
    pub fn new(
        min_separation: u32,
        decays: &[f64],
        scales: &[f64],
        max_values: u64,
        lattice_bits: u32,
    ) -> Result<Self, String> {
        check_blt(decays, scales)?;
        if let Some(bad) = decays
            .iter()
            .chain(scales)
            .find(|x| (**x / BLT_QUANTUM).fract() != 0.0)
        {
            return Err(format!(
                "BLT numbers are multiples of 2^-52 (got {bad:e}; round with `quantize`)"
            ));
        }
        check_min_separation(min_separation)?;
        if !(1..=MAX_BLT_VALUES).contains(&max_values) {
            return Err(format!(
                "max_values {max_values} (must be in 1..={MAX_BLT_VALUES})"
            ));
        }
        if lattice_bits > MAX_LATTICE_BITS {
            return Err(format!(
                "lattice_bits {lattice_bits} (must be in 0..={MAX_LATTICE_BITS})"
            ));
        }
        let mut out = Self {
            min_separation,
            max_values,
            lattice_bits,
            buffers: decays.len() as u8,
            decays: [0; MAX_BLT_BUFFERS],
            scales: [0; MAX_BLT_BUFFERS],
        };
        for (i, (t, w)) in decays.iter().zip(scales).enumerate() {
            out.decays[i] = t.to_bits();
            out.scales[i] = w.to_bits();
        }
        Ok(out)
    }

    /// The decays `theta`, in decreasing order.
    pub fn decays(&self) -> Vec<f64> {
        self.decays[..usize::from(self.buffers)]
            .iter()
            .map(|b| f64::from_bits(*b))
            .collect()
    }

    /// The scales `omega`, in the order of the decays.
    pub fn scales(&self) -> Vec<f64> {
        self.scales[..usize::from(self.buffers)]
            .iter()
            .map(|b| f64::from_bits(*b))
            .collect()
    }

    pub fn buffers(&self) -> usize {
        usize::from(self.buffers)
    }

    /// Parses what follows `blt_on_grid;` (canonical form is checked by the caller).
    pub fn parse_params(rest: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "{BLT_MECHANISM};{rest} (expected min_separation=<b>;buffers=<theta>:<omega>,...;max_values=<D>;lattice_bits=<m>)"
            )
        };
        let fields: Vec<&str> = rest.split(';').collect();
        let [separation, buffers, max_values, lattice_bits] = fields[..] else {
            return Err(bad());
        };
        let value = |field: &str, name: &str| -> Result<String, String> {
            field
                .strip_prefix(name)
                .and_then(|v| v.strip_prefix('='))
                .map(str::to_string)
                .ok_or_else(bad)
        };
        let (decays, scales) =
            parse_buffer_pairs(&value(buffers, "buffers")?).map_err(|_| bad())?;
        Self::new(
            value(separation, "min_separation")?
                .parse()
                .map_err(|_| bad())?,
            &decays,
            &scales,
            value(max_values, "max_values")?
                .parse()
                .map_err(|_| bad())?,
            value(lattice_bits, "lattice_bits")?
                .parse()
                .map_err(|_| bad())?,
        )
    }

    /// The policy's `mechanism` value of this noise.
    pub fn encode(&self) -> String {
        let buffers: Vec<String> = self
            .decays()
            .iter()
            .zip(self.scales())
            .map(|(t, w)| format!("{t:e}:{w:e}"))
            .collect();
        format!(
            "{BLT_MECHANISM};min_separation={};buffers={};max_values={};lattice_bits={}",
            self.min_separation,
            buffers.join(","),
            self.max_values,
            self.lattice_bits
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example() -> BltNoise {
        BltNoise::new(
            100,
            &[quantize(0.9879437955729754), quantize(0.6099329689288747)],
            &[quantize(0.2385758094449234), quantize(0.26822153963892403)],
            1 << 24,
            12,
        )
        .unwrap()
    }

    #[test]
    fn a_blt_round_trips_through_its_canonical_text() {
        let blt = example();
        let text = blt.encode();
        assert!(
            text.starts_with("blt_on_grid;min_separation=100;buffers=9.879437955729"),
            "{text}"
        );
        assert!(
            text.ends_with(";max_values=16777216;lattice_bits=12"),
            "{text}"
        );
        let rest = text.strip_prefix("blt_on_grid;").unwrap();
        assert_eq!(BltNoise::parse_params(rest), Ok(blt));
        assert_eq!(blt.buffers(), 2);
    }

    #[test]
    fn a_blt_off_the_quantum_or_out_of_range_is_refused_with_the_reason() {
        let cases: [(&str, &str); 6] = [
            (
                "min_separation=100;buffers=5e-1:1e-1;max_values=1;lattice_bits=0",
                "2^-52",
            ),
            (
                "min_separation=0;buffers=5e-1:2.5e-1;max_values=1;lattice_bits=0",
                "min_separation",
            ),
            (
                "min_separation=1;buffers=5e-1:2.5e-1;max_values=0;lattice_bits=0",
                "max_values",
            ),
            (
                "min_separation=1;buffers=5e-1:2.5e-1;max_values=1;lattice_bits=15",
                "lattice_bits",
            ),
            (
                "min_separation=1;buffers=5e-1:5e-1;max_values=1;lattice_bits=0",
                "below 1",
            ),
            (
                "min_separation=1;buffers=5e-1;max_values=1;lattice_bits=0",
                "expected",
            ),
        ];
        for (rest, says) in cases {
            let err = BltNoise::parse_params(rest).unwrap_err();
            assert!(err.contains(says), "{rest}: {err}");
        }
        // No buffers: the identity (independent noise on every round's increment).
        let identity =
            BltNoise::parse_params("min_separation=5;buffers=;max_values=1;lattice_bits=0")
                .unwrap();
        assert_eq!(identity.buffers(), 0);
    }
}
