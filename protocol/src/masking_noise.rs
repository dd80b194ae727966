//! The keys of a masked round's distributed noise (docs/secure-aggregation.md, "Distributed
//! noise"; docs/protocol.md, "Masks").
//!
//! Every holder of group `G` must draw the same noise for the agreed set `I` (so holders still
//! cross-check, and a repeated request gets the same answer), and nobody outside `G`'s holders
//! may be able to draw it. Only `G`'s holders know every input's seed of `G`; so the key is
//!
//! ```text
//! SHA-256("confed mask noise key v1" 0x00 decimal(G) 0x00 || B_1 || ... || B_k)
//! ```
//!
//! where `B_i` is input `i`'s noise block of group `G` (AES-256 under its seed of a block bound to
//! the input's context, as its stream key is, under another label: `MaskContext::noise_block`),
//! the inputs in the agreed set's order (refs ascending). One honest device's unknown seed makes
//! the key unknown to whoever lacks it.

use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use crate::masking::{MaskContext, MaskingError, Seed};

const KEY_LABEL: &[u8] = b"confed mask noise key v1";

/// The noise keys of one key service's groups, built input by input in the agreed set's order.
pub struct NoiseKeys {
    /// (group, the noise blocks so far), wiped when dropped.
    groups: Vec<(usize, Zeroizing<Vec<u8>>)>,
}

impl NoiseKeys {
    /// Keys for `groups` (a key service's groups, ascending), over no input yet, with room for
    /// `inputs` inputs (the blocks never move, so no unwiped copy is left behind; more inputs
    /// than that are taken, at the cost of a reallocation).
    pub fn new(groups: &[usize], inputs: usize) -> Self {
        Self {
            groups: groups
                .iter()
                .map(|&group| (group, Zeroizing::new(Vec::with_capacity(16 * inputs))))
                .collect(),
        }
    }

    /// Takes the next input of the agreed set: its opened seeds, one per group, in the groups'
    /// order.
    pub fn absorb(
        &mut self,
        seeds: &[(usize, Seed)],
        context: &MaskContext<'_>,
    ) -> Result<(), MaskingError> {
        if seeds.len() != self.groups.len()
            || seeds
                .iter()
                .zip(&self.groups)
                .any(|((g, _), (h, _))| g != h)
        {
            return Err(MaskingError::NoiseShape);
        }
        for ((group, seed), (_, blocks)) in seeds.iter().zip(&mut self.groups) {
            blocks.extend_from_slice(context.noise_block(seed, *group).as_slice());
        }
        Ok(())
    }

    /// Each group's key.
    pub fn finish(self) -> Vec<(usize, Zeroizing<[u8; 32]>)> {
        self.groups
            .iter()
            .map(|(group, blocks)| {
                let mut hash = Sha256::new();
                hash.update(KEY_LABEL);
                hash.update([0]);
                hash.update(group.to_string().as_bytes());
                hash.update([0]);
                hash.update(blocks.as_slice());
                let mut key = Zeroizing::new([0u8; 32]);
                key.copy_from_slice(&hash.finalize());
                (*group, key)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: &str = "1111111111111111111111111111111111111111111111111111111111111111";

    fn reference(i: u8) -> String {
        format!("{i:02x}").repeat(32)
    }

    fn keys(seeds: &[[u8; 32]], round: u64) -> Vec<(usize, Zeroizing<[u8; 32]>)> {
        let refs: Vec<String> = (0..seeds.len() as u8).map(reference).collect();
        let mut keys = NoiseKeys::new(&[4], seeds.len());
        for (seed, r) in seeds.iter().zip(&refs) {
            let context = MaskContext::new("task", round, r, POLICY, 10).unwrap();
            keys.absorb(&[(4, Seed::from_bytes(*seed))], &context)
                .unwrap();
        }
        keys.finish()
    }

    #[test]
    fn a_group_key_depends_on_every_seed_and_the_round_and_nothing_else() {
        let seeds = [[1u8; 32], [2; 32], [3; 32]];
        let key = keys(&seeds, 7);
        assert_eq!(key.len(), 1);
        assert_eq!(key[0].0, 4);
        assert_eq!(*key[0].1, *keys(&seeds, 7)[0].1, "deterministic");
        assert_ne!(*key[0].1, *keys(&seeds, 8)[0].1, "another round");
        for changed in 0..3 {
            let mut other = seeds;
            other[changed][0] ^= 1;
            assert_ne!(*key[0].1, *keys(&other, 7)[0].1, "seed {changed}");
        }
        assert_ne!(*key[0].1, *keys(&seeds[..2], 7)[0].1, "one input fewer");
    }

    #[test]
    fn seeds_of_other_groups_are_refused() {
        let r = reference(1);
        let context = MaskContext::new("task", 1, &r, POLICY, 10).unwrap();
        let mut keys = NoiseKeys::new(&[0, 2], 1);
        let wrong = [
            (0, Seed::from_bytes([1; 32])),
            (1, Seed::from_bytes([2; 32])),
        ];
        assert!(keys.absorb(&wrong, &context).is_err());
        assert!(keys.absorb(&wrong[..1], &context).is_err());
    }
}
