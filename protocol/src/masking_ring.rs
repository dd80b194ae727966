//! The ring masked values live in (2^64, or 2^32 when a round's sum fits 31 bits), and the
//! room distributed noise needs when the enclave checks an unmasked sum (docs/secure-
//! aggregation.md, "The ring", "The unmask check").

/// The ring masked values live in: the integers mod 2^64, or mod 2^32 when the round's sum and
/// noise fit in 31 bits (a masked update then has the bytes of an f32 update; the policy's
/// `masking` line says `ring=32`). Values of either are held in u64, reduced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Ring {
    #[default]
    Bits64,
    Bits32,
}

impl Ring {
    /// Bytes per value on the wire (little endian).
    pub fn bytes(self) -> usize {
        match self {
            Self::Bits64 => 8,
            Self::Bits32 => 4,
        }
    }

    pub fn bits(self) -> u32 {
        8 * self.bytes() as u32
    }

    /// `value mod 2^bits`.
    pub fn reduce(self, value: u64) -> u64 {
        match self {
            Self::Bits64 => value,
            Self::Bits32 => value & 0xffff_ffff,
        }
    }

    /// The signed integer a reduced value stands for (two's complement of the ring's width).
    pub fn signed(self, value: u64) -> i64 {
        match self {
            Self::Bits64 => value as i64,
            Self::Bits32 => i64::from(value as u32 as i32),
        }
    }

    /// A value of `bytes` (the ring's width, little endian).
    fn read(self, bytes: &[u8]) -> u64 {
        match self {
            Self::Bits64 => u64::from_le_bytes(bytes.try_into().expect("8 bytes")),
            Self::Bits32 => u64::from(u32::from_le_bytes(bytes.try_into().expect("4 bytes"))),
        }
    }

    /// Appends a reduced value's bytes (little endian) to `out`.
    pub fn write(self, value: u64, out: &mut Vec<u8>) {
        match self {
            Self::Bits64 => out.extend_from_slice(&value.to_le_bytes()),
            Self::Bits32 => out.extend_from_slice(&(value as u32).to_le_bytes()),
        }
    }

    /// Adds little-endian values of this ring's width from `words` to `sums`, wrapping mod 2^64
    /// (congruent mod 2^32 too: whoever reads the sums reduces them), value by value.
    pub fn accumulate(self, sums: &mut [u64], words: &[u8]) {
        match self {
            Self::Bits64 => {
                for (sum, word) in sums.iter_mut().zip(words.chunks_exact(8)) {
                    *sum = sum.wrapping_add(u64::from_le_bytes(word.try_into().expect("8 bytes")));
                }
            }
            Self::Bits32 => {
                for (sum, word) in sums.iter_mut().zip(words.chunks_exact(4)) {
                    let word = u32::from_le_bytes(word.try_into().expect("4 bytes"));
                    *sum = sum.wrapping_add(u64::from(word));
                }
            }
        }
    }

    /// Little-endian values of this ring's width, reduced, as u64.
    pub fn values(self, bytes: &[u8]) -> Vec<u64> {
        bytes
            .chunks_exact(self.bytes())
            .map(|w| self.read(w))
            .collect()
    }

    /// The masked update's tensor dtype.
    pub(crate) fn dtype(self) -> safetensors::Dtype {
        match self {
            Self::Bits64 => safetensors::Dtype::U64,
            Self::Bits32 => safetensors::Dtype::U32,
        }
    }

    /// Whether a sum of `included` inputs each within `units_per_clip` grid units per value,
    /// plus noise within `noise_per_value` per value, never wraps: every value of it lies in
    /// `(-2^(bits-1), 2^(bits-1))`, so its reduced form reads back as itself.
    pub fn holds(self, included: u64, units_per_clip: u64, noise_per_value: f64) -> bool {
        let sum = u128::from(included) * u128::from(units_per_clip);
        let noise = noise_per_value.max(0.0).ceil();
        let limit = 1u128 << (self.bits() - 1);
        noise < limit as f64 && sum + (noise as u128) < limit
    }
}

/// `-ln(2^-128)`, rounded up: the tail the noise bounds leave.
const NOISE_TAIL: f64 = 89.0;

/// The room distributed noise needs in `unmask`'s check: the summed noise `N` of `groups` groups
/// (each value a discrete Gaussian of variance parameter `variance`, so `s`-subgaussian with
/// `s = sqrt(groups variance)`) has `||N|| <= norm` and `|<S, N>| <= ||S|| spread` for the
/// updates' sum `S` (fixed before the noise is known), both but with probability below 2^-126
/// (`3 e^-89`).
/// `norm` is Hsu, Kakade and Zhang's bound `s sqrt(m + 2 sqrt(89 m) + 178)`; `spread` is `s
/// sqrt(2 x 89)`. The default, no room, is a round without distributed noise.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct NoiseRoom {
    pub norm: f64,
    pub spread: f64,
}

impl NoiseRoom {
    pub fn of(values: usize, variance: u64, groups: usize) -> Self {
        let m = values as f64;
        let s2 = variance as f64 * groups as f64;
        Self {
            norm: (s2 * (m + 2.0 * (m * NOISE_TAIL).sqrt() + 2.0 * NOISE_TAIL)).sqrt(),
            spread: (s2 * 2.0 * NOISE_TAIL).sqrt(),
        }
    }
}

/// A bound no value of the summed distributed noise of `groups` groups (each value a discrete
/// Gaussian of variance parameter `variance`, `sigma`-subgaussian) exceeds in absolute value,
/// over up to 2^32 values, but with probability below 2^-128: `15 sqrt(groups variance)`
/// (`sqrt(2 ln(2 x 2^32 x 2^128)) = 14.94`).
pub fn noise_value_bound(variance: u64, groups: usize) -> f64 {
    15.0 * (variance as f64 * groups as f64).sqrt()
}
