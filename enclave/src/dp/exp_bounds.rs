//! The exact end of BLT's sampler (`sampler_steps`): whether a uniform `U` in [0, 1) lies below
//! `exp(-p/q) 2^shift / k`, decided with rigorous bounds on `exp(-p/q)` in arbitrary precision and
//! as many of `U`'s binary digits as it takes. The sampler's floating-point test decides all but
//! about one acceptance in 2^31 by itself; this decides the rest, so the sampler stays exact.
//!
//! Bounds come from the alternating Taylor series of `exp(-t)` for `t = p / (q 2^h) < 1` (its
//! partial sums of odd length are below `exp(-t)`, of even length above, because the terms
//! `t^n / n!` do not increase), in fixed point rounded outwards, then squared `h` times with the
//! lower bound rounded down and the upper up. Each undecided comparison reads 32 more digits of
//! `U` and takes 64 more bits of precision. It ends with probability 1: `exp(-p/q)` is irrational for `p >
//! 0`, and a dyadic `U` boundary of a rational is met in finitely many digits.

use dashu_int::UBig;
use rand_core::RngCore;

use super::sampler_bits::Bits;

/// Fractional bits of the first attempt.
const FIRST_PRECISION: usize = 128;

/// Whether `U < exp(-p/q) 2^shift / k` (`q`, `k` > 0), where `U`'s first 32 binary digits are
/// `prefix` and its further digits are read from `bits` as needed.
pub(super) fn below<R: RngCore>(
    bits: &mut Bits<'_, R>,
    prefix: u64,
    (p, q): (u128, u128),
    shift: usize,
    k: u128,
) -> bool {
    let k = UBig::from(k);
    let mut known = UBig::from(prefix);
    let mut digits = 32usize;
    let mut precision = FIRST_PRECISION;
    loop {
        // U in [known, known + 1) / 2^digits; exp(-p/q) in [low, high] / 2^precision.
        let (low, high) = exp_bounds(p, q, precision);
        let scale = shift + digits;
        if ((&known + UBig::ONE) * &k) << precision <= low << scale {
            return true;
        }
        if (&known * &k) << precision >= high << scale {
            return false;
        }
        known = (known << 32) + UBig::from(bits.bits(32));
        digits += 32;
        // Linear growth: each undecided round is as likely as the last to be the final one, so
        // the work of one comparison stays bounded by the digits it read.
        precision += 64;
    }
}

/// `(low, high)` with `low / 2^precision <= exp(-p/q) <= high / 2^precision` (`q` > 0).
pub(super) fn exp_bounds(p: u128, q: u128, precision: usize) -> (UBig, UBig) {
    if p == 0 {
        let one = UBig::ONE << precision;
        return (one.clone(), one);
    }
    // p < 2^bit_len(p) <= q 2^halvings: t = p / (q 2^halvings) < 1.
    let halvings = (bit_len(p) + 1).saturating_sub(bit_len(q));
    // Each squaring doubles the relative width; the guard digits absorb it and the roundings.
    let guard = halvings + 64;
    let fraction = precision + guard;
    let unit = UBig::ONE << fraction;
    let t_low = (UBig::from(p) << fraction) / (UBig::from(q) << halvings);
    let t_high = &t_low + UBig::ONE;
    // Bounds on each term t^n / n!, and on the partial sums' even and odd parts.
    let (mut term_low, mut term_high) = (unit.clone(), unit.clone());
    let (mut even_low, mut even_high) = (unit.clone(), unit.clone());
    let (mut odd_low, mut odd_high) = (UBig::ZERO, UBig::ZERO);
    let mut n = 1usize;
    let last_odd_low = loop {
        term_low = (&term_low * &t_low) / (UBig::from(n) << fraction);
        term_high = ceil_div(&term_high * &t_high, UBig::from(n) << fraction);
        if n % 2 == 1 {
            odd_low += &term_low;
            odd_high += &term_high;
            if term_high <= UBig::ONE {
                break term_low.clone();
            }
        } else {
            even_low += &term_low;
            even_high += &term_high;
        }
        n += 1;
    };
    // S_n (n odd) <= exp(-t) <= S_(n-1).
    let mut low = if even_low > odd_high {
        even_low - odd_high
    } else {
        UBig::ZERO
    };
    let odd_before = odd_low - last_odd_low;
    let mut high = (even_high - odd_before).min(unit.clone());
    for _ in 0..halvings {
        low = (&low * &low) >> fraction;
        high = ceil_div(&high * &high, unit.clone()).min(unit.clone());
    }
    let guard_unit = UBig::ONE << guard;
    (low >> guard, ceil_div(high, guard_unit))
}

fn ceil_div(n: UBig, d: UBig) -> UBig {
    let (quotient, remainder) = (&n / &d, &n % &d);
    if remainder == UBig::ZERO {
        quotient
    } else {
        quotient + UBig::ONE
    }
}

fn bit_len(x: u128) -> usize {
    (u128::BITS - x.leading_zeros()) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use dashu_int::ops::BitTest;
    use rand_chacha::ChaCha12Rng;
    use rand_core::SeedableRng;

    fn as_f64(x: &UBig, precision: usize) -> f64 {
        // Exact enough for the checks: the top 64 bits, scaled.
        let len = x.bit_len();
        let drop = len.saturating_sub(64);
        let top = u64::try_from(x >> drop).unwrap_or(u64::MAX) as f64;
        top * 2f64.powi(drop as i32 - precision as i32)
    }

    #[test]
    fn the_bounds_hold_exp_and_are_tight() {
        for (p, q) in [
            (1u128, 1u128),
            (1, 2),
            (1, 3),
            (7, 5),
            (123_456_789, 1 << 40),
            (800, 1),
            (3 << 70, 1 << 62),
            (51_000, 2),
        ] {
            let x = p as f64 / q as f64;
            let (low, high) = exp_bounds(p, q, 200);
            assert!(low <= high, "{p}/{q}");
            let (lo, hi) = (as_f64(&low, 200), as_f64(&high, 200));
            let e = (-x).exp();
            if e > 1e-300 {
                assert!(
                    lo <= e * (1.0 + 1e-15) && e <= hi * (1.0 + 1e-15),
                    "{p}/{q}: {lo} {e} {hi}"
                );
                assert!(
                    (hi - lo) <= e * 1e-15 + 2f64.powi(-190),
                    "{p}/{q}: width {}",
                    hi - lo
                );
            } else {
                assert!(hi <= 2f64.powi(-190), "{p}/{q}: {hi}");
            }
        }
        let (low, high) = exp_bounds(0, 5, 64);
        assert_eq!((low.clone(), high), (UBig::ONE << 64, UBig::ONE << 64));
    }

    #[test]
    fn more_precision_narrows_the_bounds_around_the_same_value() {
        let (a_low, a_high) = exp_bounds(2, 3, 128);
        let (b_low, b_high) = exp_bounds(2, 3, 512);
        assert!(a_low.clone() << 384 <= b_low && b_low <= b_high);
        assert!(b_high <= a_high << 384);
        assert!(&b_high - &b_low <= UBig::from(1u8 << 7));
    }

    #[test]
    fn the_exact_comparison_gives_the_probability() {
        // U < exp(-1/2) 2^2 / 5 = 0.4852...: decided exactly, with uniform prefixes.
        let mut rng = ChaCha12Rng::from_seed([8; 32]);
        let mut bits = Bits::new(&mut rng);
        let trials = 20_000;
        let p = 4.0 * (-0.5f64).exp() / 5.0;
        let hits = (0..trials)
            .filter(|_| {
                let prefix = bits.bits(32);
                below(&mut bits, prefix, (1, 2), 2, 5)
            })
            .count() as f64;
        let sd = (p * (1.0 - p) * trials as f64).sqrt();
        assert!((hits - p * trials as f64).abs() < 5.0 * sd, "{hits}");
    }

    /// An RNG of one repeated word that counts its reads.
    struct Words {
        word: u64,
        reads: usize,
    }

    impl RngCore for Words {
        fn next_u32(&mut self) -> u32 {
            self.next_u64() as u32
        }
        fn next_u64(&mut self) -> u64 {
            self.reads += 1;
            self.word
        }
        fn fill_bytes(&mut self, dest: &mut [u8]) {
            dest.fill(self.word as u8);
        }
    }

    fn decide(word: u64, prefix: u64) -> (bool, usize) {
        let mut rng = Words { word, reads: 0 };
        let below = below(&mut Bits::new(&mut rng), prefix, (1, 1), 0, 1);
        (below, rng.reads)
    }

    #[test]
    fn a_prefix_at_the_boundary_reads_further_digits() {
        // exp(-1) = 0.367879...: with its own first 32 digits as the prefix U's side is
        // undecided, and the next digits decide (all ones: above; all zeros: below).
        let prefix = ((-1f64).exp() * 2f64.powi(32)).floor() as u64;
        assert_eq!(decide(u64::MAX, prefix), (false, 1));
        assert_eq!(decide(0, prefix), (true, 1));
        // A prefix clear of the boundary decides without reading a digit more.
        assert_eq!(decide(0, prefix - 1), (true, 0));
        assert_eq!(decide(u64::MAX, prefix + 1), (false, 0));
    }
}
