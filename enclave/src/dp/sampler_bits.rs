//! An exact discrete Gaussian for BLT noise: the same distribution as `sampler` (the same
//! integer variance parameter), by another exact algorithm that spends far fewer random digits
//! and unpredictable branches: Karney's discrete normal (2016, "Sampling exactly from the normal
//! distribution", Algorithm D; `DiscreteGaussian::sample_bits`), its acceptance tests done as
//! Bernoulli trials of rationals (Canonne, Kamath and Steinke 2020, Algorithm 1).
//!
//! A Bernoulli(n / m) compares a uniform U in [0, 1) with n / m 16 binary digits at a time (one
//! comparison and, on a tie, one time in 65,536, the next 16; the digits of the trials of
//! exp(-1/2) and exp(-1), which make most of the work, precomputed) when m <= 2^48, one digit at
//! a time above (the acceptance test's trials at variances from 2^46 up). Uniform integers below
//! `w` take `ceil(log2 w)` bits with rejection. The
//! values drawn from a given stream differ from `sampler`'s, which is why it serves only BLT
//! noise (new with it): a retried round of an existing mechanism must reproduce its noise bit for
//! bit across enclave versions, or a release the untrusted store saw but did not commit could be
//! followed by a differently noised one.
//!
//! At the grid's typical scales it draws 10-11 M samples/s on one core here (9.3-9.4 M at the
//! BLT lattice's, a standard deviation near 2^29 units), the first version
//! (`sampler`'s algorithm, digit by digit) 8 M (docs/performance.md); a profile showed the time
//! in branches on random outcomes, so the hot paths take one branch per Bernoulli trial.

use rand_core::RngCore;

use super::DiscreteGaussian;

/// Binary digits a Bernoulli(n / m) compares at once.
const CHUNK: u32 = 16;

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

    #[inline(always)]
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

    /// `CHUNK` bits as an integer: the hot path, inlined (a word holds four chunks; a call per
    /// draw cost a third of the sampler's time).
    #[inline(always)]
    fn chunk(&mut self) -> u64 {
        if self.left >= CHUNK {
            let out = self.word & ((1 << CHUNK) - 1);
            self.word >>= CHUNK;
            self.left -= CHUNK;
            return out;
        }
        self.bits(CHUNK)
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

    /// Bernoulli(n / m) for m <= 2^127: a uniform U in [0, 1) is below n / m iff, at the first
    /// binary digit where they differ, U's is 0. Up to m = 2^48, sixteen digits at once: n / m
    /// = (q + r / m) / 2^16, so U < n / m iff its first 16 digits W are below q, or equal to q
    /// (one time in 65,536) and the rest of U is below r / m, decided the same way. One division
    /// and one branch on a random outcome. Above, one digit at a time (two on average).
    fn ratio(&mut self, mut n: u128, m: u128) -> bool {
        debug_assert!(m <= 1 << 127, "{m} leaves no room for a digit");
        loop {
            if n >= m {
                return true;
            }
            if n == 0 {
                return false;
            }
            if m > 1 << 48 {
                return self.ratio_by_digits(n, m);
            }
            // n < m <= 2^48: n 2^16 fits a word.
            let (n64, m64) = (n as u64, m as u64);
            let (q, r) = ((n64 << CHUNK) / m64, (n64 << CHUNK) % m64);
            let w = self.chunk();
            if w != q {
                return w < q;
            }
            n = u128::from(r);
        }
    }

    /// `ratio` one binary digit at a time, for 0 < n < m <= 2^127.
    fn ratio_by_digits(&mut self, n: u128, m: u128) -> bool {
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
        let Some(dk) = d.checked_mul(k).filter(|dk| *dk <= 1 << 127) else {
            // d k > 2^127 needs more than 2^66 consecutive successes (d <= 2^61), probability
            // below 1 / (2^66)!: the chain stops there, as in `sampler`.
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
        if !exp_minus(bits, &ONE) {
            return false;
        }
        n -= d;
    }
    exp_fraction(bits, n, d)
}

/// `k` in 0..=MAX_INTERVAL with probability proportional to `exp(-k^2 / 2)` (Karney 2016,
/// Algorithm D, steps D1-D2): `k` successes of Bernoulli(exp(-1/2)) before a failure
/// (probability proportional to `exp(-k/2)`), accepted with probability `exp(-k (k - 1) / 2)`;
/// a `k` above the cap starts over (conditioning on the cap, whose mass is below exp(-2^39)).
fn half_normal_interval<R: RngCore>(bits: &mut Bits<'_, R>) -> u64 {
    'draw: loop {
        let mut k: u64 = 0;
        while exp_minus(bits, &HALF) {
            k += 1;
        }
        if k > MAX_INTERVAL {
            continue;
        }
        // exp(-k (k - 1) / 2) = exp(-1)^(k (k - 1) / 2), a whole power.
        for _ in 0..k * k.saturating_sub(1) / 2 {
            if !exp_minus(bits, &ONE) {
                continue 'draw;
            }
        }
        return k;
    }
}

/// Algorithm 1's trials for a fixed `gamma`: Bernoulli(gamma / k) for k = 1, 2, ..., each as
/// `n / m` and its first `CHUNK` binary digits `q` with the rest `r / m` (`n 2^CHUNK = q m + r`).
struct Trials {
    /// (q, r, m) for k = 1..=TRIALS.
    trials: [(u64, u64, u64); TRIALS],
    /// gamma = n / d.
    n: u64,
    d: u64,
}

const TRIALS: usize = 12;

const fn trials(n: u64, d: u64) -> Trials {
    let mut trials = [(0, 0, 0); TRIALS];
    let mut k = 0;
    while k < TRIALS {
        let m = d * (k as u64 + 1);
        trials[k] = ((n << CHUNK) / m, (n << CHUNK) % m, m);
        k += 1;
    }
    Trials { trials, n, d }
}

/// exp(-1/2) and exp(-1)'s trials.
const HALF: Trials = trials(1, 2);
const ONE: Trials = trials(1, 1);

/// Bernoulli(exp(-gamma)) for a fixed gamma <= 1 (Algorithm 1 over precomputed trials): each
/// trial is decided by one comparison of `CHUNK` random digits with its `q`, without a
/// division, and only a tie (one time in 2^CHUNK) reads the further digits of `r / m`; a certain
/// trial (gamma / k = 1) draws nothing. It draws exactly what `exp_fraction(n, d)` draws.
fn exp_minus<R: RngCore>(bits: &mut Bits<'_, R>, gamma: &Trials) -> bool {
    for (k, &(q, r, m)) in gamma.trials.iter().enumerate() {
        let success = if q >> CHUNK != 0 {
            true
        } else {
            let w = bits.chunk();
            if w != q {
                w < q
            } else {
                bits.ratio(u128::from(r), u128::from(m))
            }
        };
        if !success {
            return k % 2 == 0;
        }
    }
    // Twelve successes (probability gamma^12 / 12!): the rest of the chain, exactly.
    let (n, d) = (u128::from(gamma.n), u128::from(gamma.d));
    let mut k = TRIALS as u128 + 1;
    loop {
        if !bits.ratio(n, d * k) {
            return k % 2 == 1;
        }
        k += 1;
    }
}

/// Largest interval index taken: beyond it the half-normal's mass is below exp(-2^39), and a
/// draw there starts over (so every product below stays far inside u128).
const MAX_INTERVAL: u64 = 1 << 20;

impl DiscreteGaussian {
    /// One sample, drawing from `bits`: Karney's exact discrete normal (Karney 2016, "Sampling
    /// exactly from the normal distribution", Algorithm D, with mean 0), its acceptance tests
    /// done exactly in integers. The half-line is cut into intervals `[k sigma, (k+1) sigma)`;
    /// interval `k` is chosen with probability proportional to `exp(-k^2 / 2)`, an integer `i` of
    /// it uniformly among `ceil(sigma)` candidates from `ceil(k sigma)` (one past the interval is
    /// refused: `i^2 >= (k+1)^2 sigma^2`), and accepted with probability `exp(-((i / sigma)^2 -
    /// k^2) / 2) = exp(-(i^2 - k^2 sigma^2) / (2 sigma^2))`, a ratio of integers (Bernoulli
    /// trials of Canonne, Kamath and Steinke's Algorithm 1). Every `i` then comes out with
    /// probability proportional to `exp(-i^2 / (2 sigma^2))`; a random sign, with `-0` refused,
    /// makes it the discrete Gaussian of integer variance parameter `sigma^2`, exactly (up to the
    /// interval cap, `MAX_INTERVAL`, which truncates the output to |i| < (2^20 + 1) sigma).
    pub fn sample_bits<R: RngCore>(&self, bits: &mut Bits<'_, R>) -> i64 {
        let (sigma2, _) = self.parameters();
        let sigma2 = u128::from(sigma2);
        let width = self.interval_start(1) as u64;
        loop {
            let k = half_normal_interval(bits);
            let i = self.interval_start(k) + u128::from(bits.below(width));
            let next = u128::from(k + 1);
            if i * i >= next * next * sigma2 {
                continue;
            }
            let negative = bits.bit();
            if negative && i == 0 {
                continue;
            }
            let k = u128::from(k);
            if exp(bits, i * i - k * k * sigma2, 2 * sigma2) {
                return if negative { -(i as i64) } else { i as i64 };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha12Rng;
    use rand_core::SeedableRng;

    /// An RNG that replays `words`.
    struct Script(Vec<u64>);

    impl RngCore for Script {
        fn next_u32(&mut self) -> u32 {
            self.next_u64() as u32
        }
        fn next_u64(&mut self) -> u64 {
            assert!(!self.0.is_empty(), "the script ran out");
            self.0.remove(0)
        }
        fn fill_bytes(&mut self, dest: &mut [u8]) {
            for chunk in dest.chunks_mut(8) {
                let word = self.next_u64().to_le_bytes();
                chunk.copy_from_slice(&word[..chunk.len()]);
            }
        }
    }

    /// 16-bit chunks packed into words, first chunk lowest.
    fn chunks(values: &[u64]) -> Vec<u64> {
        values
            .chunks(4)
            .map(|c| c.iter().enumerate().map(|(i, v)| v << (16 * i)).sum())
            .collect()
    }

    #[test]
    fn the_precomputed_trials_draw_exactly_what_algorithm_1_draws() {
        for (gamma, (n, d)) in [(&HALF, (1u128, 2u128)), (&ONE, (1, 1))] {
            let mut left = ChaCha12Rng::from_seed([5; 32]);
            let mut right = ChaCha12Rng::from_seed([5; 32]);
            let (mut a, mut b) = (Bits::new(&mut left), Bits::new(&mut right));
            for trial in 0..300_000 {
                assert_eq!(
                    exp_minus(&mut a, gamma),
                    exp_fraction(&mut b, n, d),
                    "trial {trial}"
                );
            }
            assert_eq!(a.bits(64), b.bits(64), "the same bits consumed");
        }
    }

    #[test]
    fn the_chain_past_the_table_keeps_algorithm_1s_parity() {
        // Twelve successes (chunks 0), then trial 13 fails (0xFFFF): K = 13, odd: true.
        let mut script = Script(chunks(&[0; 12]).into_iter().chain([u64::MAX]).collect());
        assert!(exp_minus(&mut Bits::new(&mut script), &HALF));
        // Trial 13 succeeds, 14 fails: K = 14, even: false.
        let mut script = Script(chunks(&[&[0; 13][..], &[0xFFFF; 3]].concat()));
        assert!(!exp_minus(&mut Bits::new(&mut script), &HALF));
        // exp(-1)'s first trial is certain and draws nothing: twelve zero chunks carry it to
        // trial 13, and 0xFFFF fails trial 14: false.
        let mut script = Script(chunks(&[&[0; 12][..], &[0xFFFF; 4]].concat()));
        assert!(!exp_minus(&mut Bits::new(&mut script), &ONE));
    }

    #[test]
    fn a_tie_in_sixteen_digits_is_decided_by_the_next_sixteen() {
        // 1/3: q = 21845, r = 1; 1/2: q = 32768, r = 0.
        let decide = |n: u128, m: u128, drawn: &[u64]| {
            let mut padded = drawn.to_vec();
            padded.resize(4, 0);
            ratio_of(n, m, chunks(&padded))
        };
        assert!(decide(1, 3, &[21845, 0]));
        assert!(!decide(1, 3, &[21845, 0xFFFF]));
        assert!(decide(1, 3, &[21844]));
        assert!(!decide(1, 3, &[21846]));
        assert!(!decide(1, 2, &[32768]));
        assert!(decide(1, 2, &[32767]));
    }

    fn ratio_of(n: u128, m: u128, words: Vec<u64>) -> bool {
        let mut script = Script(words);
        Bits::new(&mut script).ratio(n, m)
    }

    #[test]
    fn ratios_by_digits_and_by_chunks_agree() {
        let mut rng = ChaCha12Rng::from_seed([6; 32]);
        let mut bits = Bits::new(&mut rng);
        let trials = 200_000;
        for (n, m) in [(1u128, 3u128), (5, 7)] {
            let fast = (0..trials).filter(|_| bits.ratio(n, m)).count() as f64;
            let slow = (0..trials).filter(|_| bits.ratio(n << 60, m << 60)).count() as f64;
            let p = n as f64 / m as f64;
            let sd = (p * (1.0 - p) * trials as f64).sqrt();
            for hits in [fast, slow] {
                assert!(
                    (hits - p * trials as f64).abs() < 5.0 * sd,
                    "{n}/{m}: {hits}"
                );
            }
        }
    }

    #[test]
    fn interval_starts_are_the_exact_ceilings_of_k_sigma() {
        for sigma2 in [
            1u64,
            2,
            3,
            4,
            7,
            1000,
            123_457,
            937_000 * 937_000 + 12_345,
            (1 << 60) - 1,
            1 << 60,
        ] {
            let g = DiscreteGaussian::with_variance(sigma2);
            for k in (0..=20).chain([1 << 20]) {
                let start = g.interval_start(k);
                let v = u128::from(k) * u128::from(k) * u128::from(sigma2);
                assert!(start * start >= v, "{sigma2} {k}");
                assert!(start == 0 || (start - 1) * (start - 1) < v, "{sigma2} {k}");
            }
        }
    }

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
