//! Random bits for the step sampler (`sampler_steps`: a Gaussian round's release, BLT), drawn from the caller's RNG 64 at a time
//! and handed out in the counts the sampler asks for, none wasted: the stream-to-value map is
//! part of what makes a retried round reproduce its noise.

use rand_core::RngCore;

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
    pub fn bit(&mut self) -> bool {
        if self.left == 0 {
            self.word = self.rng.next_u64();
            self.left = 64;
        }
        let bit = self.word & 1 == 1;
        self.word >>= 1;
        self.left -= 1;
        bit
    }

    /// `count` (1..=64) bits as an integer, the first drawn lowest.
    #[inline]
    pub fn bits(&mut self, count: u32) -> u64 {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha12Rng;
    use rand_core::SeedableRng;

    #[test]
    fn reads_that_straddle_a_word_keep_every_bit_in_order() {
        let mut rng = ChaCha12Rng::from_seed([4; 32]);
        let words: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
        let mut rng = ChaCha12Rng::from_seed([4; 32]);
        let mut bits = Bits::new(&mut rng);
        let a = bits.bits(40);
        let b = bits.bits(40);
        let c = bits.bit();
        let d = bits.bits(64);
        assert_eq!(a, words[0] & ((1 << 40) - 1));
        assert_eq!(b, (words[0] >> 40) | ((words[1] & ((1 << 16) - 1)) << 24));
        assert_eq!(c, (words[1] >> 16) & 1 == 1);
        assert_eq!(d, (words[1] >> 17) | (words[2] << 47));
    }
}
