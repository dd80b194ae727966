//! The same exact discrete Gaussian (Canonne, Kamath, Steinke 2020, Algorithms 1-3, with the
//! same integer variance and the same u128 bounds as `sampler`), drawing far fewer random bits:
//! every Bernoulli(n / m) compares the binary digits of a uniform draw with those of `n / m` one
//! at a time and stops at the first difference (two bits on average, instead of a 64- or 128-bit
//! uniform integer), and uniform integers below `t` take `ceil(log2 t)` bits with rejection. The
//! distribution is the same, exactly; the values drawn from a given stream are not, which is why
//! it serves only BLT noise (new with it): a retried round of an existing mechanism must
//! reproduce its noise bit for bit across enclave versions, or a release the untrusted store saw
//! but did not commit could be followed by a differently noised one.
//!
//! ChaCha12 output is the cost that dominates `sampler` (about 20 words a sample); here it is
//! about 3.

use rand_core::RngCore;

use super::DiscreteGaussian;

/// Random bits from an RNG, 64 at a time.
pub struct Bits<'a, R: RngCore> {
    rng: &'a mut R,
    word: u64,
    left: u32,
}

impl<'a, R: RngCore> Bits<'a, R> {
    pub fn new(rng: &'a mut R) -> Self {
        Self {
            rng,
            word: 0,
            left: 0,
        }
    }

    fn bit(&mut self) -> bool {
        if self.left == 0 {
            self.word = self.rng.next_u64();
            self.left = 64;
        }
        let bit = self.word & 1 == 1;
        self.word >>= 1;
        self.left -= 1;
        bit
    }

    /// `count` (1..=64) bits as an integer.
    fn bits(&mut self, count: u32) -> u64 {
        if count <= self.left {
            let out = if count == 64 {
                self.word
            } else {
                self.word & ((1u64 << count) - 1)
            };
            self.word = self.word.checked_shr(count).unwrap_or(0);
            self.left -= count;
            return out;
        }
        let have = self.left;
        let low = self.word;
        let next = self.rng.next_u64();
        let need = count - have;
        let high = if need == 64 {
            next
        } else {
            next & ((1u64 << need) - 1)
        };
        self.word = next.checked_shr(need).unwrap_or(0);
        self.left = 64 - need;
        low | high.checked_shl(have).unwrap_or(0)
    }

    /// Uniform in [0, n) for n >= 1: the fewest bits that cover n, rejecting draws >= n.
    fn below(&mut self, n: u64) -> u64 {
        if n <= 1 {
            return 0;
        }
        let width = u64::BITS - (n - 1).leading_zeros();
        loop {
            let draw = self.bits(width);
            if draw < n {
                return draw;
            }
        }
    }

    /// Bernoulli(n / m) for 0 <= n <= m, m <= 2^127: a uniform U in [0, 1) is below n / m iff,
    /// at the first binary digit where they differ, U's is 0. Exact; two bits on average.
    fn ratio(&mut self, n: u128, m: u128) -> bool {
        if n >= m {
            return true;
        }
        let mut remainder = n;
        loop {
            if remainder == 0 {
                return false;
            }
            remainder <<= 1;
            let digit = remainder >= m;
            if digit {
                remainder -= m;
            }
            if self.bit() != digit {
                return digit;
            }
        }
    }
}

/// Bernoulli(exp(-n/d)) for 0 <= n/d <= 1 (Algorithm 1).
fn exp_fraction<R: RngCore>(bits: &mut Bits<'_, R>, n: u128, d: u128) -> bool {
    let mut k: u128 = 1;
    loop {
        let Some(dk) = d.checked_mul(k) else {
            // As in `sampler`: needs k! > 2^64 consecutive successes.
            return k % 2 == 1;
        };
        if !bits.ratio(n, dk) {
            return k % 2 == 1;
        }
        k += 1;
    }
}

/// Bernoulli(exp(-n/d)) for any n/d >= 0.
fn exp<R: RngCore>(bits: &mut Bits<'_, R>, mut n: u128, d: u128) -> bool {
    while n > d {
        if !exp_fraction(bits, 1, 1) {
            return false;
        }
        n -= d;
    }
    exp_fraction(bits, n, d)
}

/// Discrete Laplace with integer scale `t` (Algorithm 2).
fn laplace<R: RngCore>(bits: &mut Bits<'_, R>, t: u64) -> i64 {
    loop {
        let u = bits.below(t);
        if !exp_fraction(bits, u128::from(u), u128::from(t)) {
            continue;
        }
        let mut v: u64 = 0;
        while exp_fraction(bits, 1, 1) {
            v += 1;
        }
        let x = u + t * v;
        let negative = bits.bit();
        if negative && x == 0 {
            continue;
        }
        return if negative { -(x as i64) } else { x as i64 };
    }
}

impl DiscreteGaussian {
    /// One sample (Algorithm 3), drawing from `bits`.
    pub fn sample_bits<R: RngCore>(&self, bits: &mut Bits<'_, R>) -> i64 {
        let (sigma2, t) = self.parameters();
        let t = u128::from(t);
        let sigma2 = u128::from(sigma2);
        let denominator = 2 * sigma2 * t * t;
        loop {
            let y = laplace(bits, t as u64);
            let offset = (u128::from(y.unsigned_abs()) * t).abs_diff(sigma2);
            let Some(numerator) = offset.checked_mul(offset) else {
                continue;
            };
            if exp(bits, numerator, denominator) {
                return y;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha12Rng;
    use rand_core::SeedableRng;

    #[test]
    fn bit_comparisons_give_the_ratio() {
        let mut rng = ChaCha12Rng::from_seed([3; 32]);
        let mut bits = Bits::new(&mut rng);
        for (n, m) in [(1u128, 3u128), (2, 3), (5, 7), (1, 1000)] {
            let trials = 200_000;
            let hits = (0..trials).filter(|_| bits.ratio(n, m)).count() as f64;
            let p = n as f64 / m as f64;
            let sd = (p * (1.0 - p) / trials as f64).sqrt();
            assert!(
                (hits / trials as f64 - p).abs() < 5.0 * sd,
                "{n}/{m}: {hits}"
            );
        }
        let mut counts = [0u32; 5];
        for _ in 0..50_000 {
            counts[bits.below(5) as usize] += 1;
        }
        assert!(
            counts.iter().all(|c| (9_500..10_500).contains(c)),
            "{counts:?}"
        );
        // Reads that straddle a word boundary keep every bit.
        let mut rng = ChaCha12Rng::from_seed([4; 32]);
        let words: Vec<u64> = (0..2).map(|_| rng.next_u64()).collect();
        let mut rng = ChaCha12Rng::from_seed([4; 32]);
        let mut bits = Bits::new(&mut rng);
        let a = bits.bits(40);
        let b = bits.bits(40);
        assert_eq!(a, words[0] & ((1 << 40) - 1));
        assert_eq!(b, (words[0] >> 40) | ((words[1] & ((1 << 16) - 1)) << 24));
    }
}
