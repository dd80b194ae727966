//! A key service's mask sums (docs/secure-aggregation.md, "The unmask"): for each of its groups,
//! the sum of that group's streams over the round's included inputs, in the layout's ring.
//!
//! The work is expanding streams: one AES-128-CTR keystream of the update's size per included
//! input and group. `MaskSums::add_many` takes every input's stream keys at once and cuts the
//! values into one range per thread, each seeking every stream to its range (CTR seeks in O(1)):
//! a key service with `k` cores sums a round up to `k` times as fast where AES, not memory,
//! bounds it (this VM's two cores gave x1.3-1.5 on a 1 MB model). Each thread adds in a buffer
//! of its range in the ring's width (4 bytes a value in the ring of 2^32, half the memory
//! traffic of 8); for a megabyte model on a few cores that range stays in the core's cache.

use aes::cipher::{KeyIvInit, StreamCipher, StreamCipherSeek};
use zeroize::Zeroizing;

use crate::masking::{
    Aes128Ctr, Layout, MaskContext, MaskingError, Ring, STREAM_CHUNK, Seed, add_stream,
};

/// Fewest keystream values (values x inputs x groups) a thread of `add_many` takes: below it,
/// starting a thread costs more than it saves (2^20 values is 4 MiB of keystream, about a
/// millisecond of AES).
const MIN_WORK_PER_THREAD: usize = 1 << 20;

/// What a key service returns for a round: for each of its groups, the sum of that group's
/// streams over the round's included inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskSums {
    pub service: u8,
    /// Each group's sum, reduced in the layout's ring.
    pub sums: Vec<(usize, Vec<u64>)>,
}

/// One included input's stream keys, one per group of a key service, for `values` values: what
/// `MaskSums::add_many` expands. Wiped when dropped.
pub struct StreamKeys {
    keys: Vec<(usize, Zeroizing<[u8; 16]>)>,
    values: usize,
}

impl StreamKeys {
    /// The stream keys of an input's opened `seeds` (group, seed) under `context`.
    pub fn of(seeds: &[(usize, Seed)], context: &MaskContext<'_>) -> Self {
        Self {
            keys: seeds
                .iter()
                .map(|(group, seed)| (*group, context.stream_key(seed, *group)))
                .collect(),
            values: context.values(),
        }
    }
}

impl MaskSums {
    /// Starts a key service's sums of `values` values, one per group it belongs to.
    pub fn new(layout: &Layout, service: u8, values: usize) -> Result<Self, MaskingError> {
        layout.check_service(service)?;
        Ok(Self {
            service,
            sums: layout
                .groups_of(service)
                .into_iter()
                .map(|group| (group, vec![0u64; values]))
                .collect(),
        })
    }

    /// Adds one included input's streams in `ring` (the layout's), from its opened seeds.
    pub fn add(
        &mut self,
        seeds: &[(usize, Seed)],
        context: &MaskContext<'_>,
        ring: Ring,
    ) -> Result<(), MaskingError> {
        self.check_groups(seeds.iter().map(|(group, _)| *group))?;
        for ((group, seed), (_, sum)) in seeds.iter().zip(&mut self.sums) {
            add_stream(seed, context, *group, sum, ring)?;
        }
        Ok(())
    }

    /// Adds every input's streams in `ring` (the layout's) on up to `threads` threads: the same
    /// sums as `add` of each input in turn, whatever the threads.
    pub fn add_many(
        &mut self,
        inputs: &[StreamKeys],
        ring: Ring,
        threads: usize,
    ) -> Result<(), MaskingError> {
        self.add_or_subtract_many(inputs, ring, threads, Sign::Add)
    }

    /// Takes every input's streams away in `ring`, in place, on up to `threads` threads: what a
    /// key service does with inputs it added ahead that the agreed set leaves out.
    pub fn subtract_many(
        &mut self,
        inputs: &[StreamKeys],
        ring: Ring,
        threads: usize,
    ) -> Result<(), MaskingError> {
        self.add_or_subtract_many(inputs, ring, threads, Sign::Subtract)
    }

    fn add_or_subtract_many(
        &mut self,
        inputs: &[StreamKeys],
        ring: Ring,
        threads: usize,
        sign: Sign,
    ) -> Result<(), MaskingError> {
        let work = self
            .sums
            .first()
            .map_or(0, |(_, sum)| sum.len())
            .saturating_mul(inputs.len())
            .saturating_mul(self.sums.len());
        let threads = threads.min(work / MIN_WORK_PER_THREAD).max(1);
        self.add_split(inputs, ring, (threads, 1), sign)
    }

    fn add_split(
        &mut self,
        inputs: &[StreamKeys],
        ring: Ring,
        (threads, min_per_thread): (usize, usize),
        sign: Sign,
    ) -> Result<(), MaskingError> {
        let values = self.sums.first().map_or(0, |(_, sum)| sum.len());
        for input in inputs {
            self.check_groups(input.keys.iter().map(|(group, _)| *group))?;
            if input.values != values {
                return Err(MaskingError::Length {
                    expected: values,
                    got: input.values,
                });
            }
        }
        if values == 0 || inputs.is_empty() {
            return Ok(());
        }
        let threads = threads.clamp(1, (values / min_per_thread.max(1)).max(1));
        // Ranges of whole chunks, so that each thread's keystream starts on a block.
        let per_thread = values.div_ceil(threads).next_multiple_of(STREAM_CHUNK);
        let mut ranges: Vec<(usize, Vec<&mut [u64]>)> = (0..threads)
            .map(|i| (i * per_thread, Vec::with_capacity(self.sums.len())))
            .collect();
        for (_, sum) in &mut self.sums {
            for (range, slice) in ranges.iter_mut().zip(sum.chunks_mut(per_thread)) {
                range.1.push(slice);
            }
        }
        ranges.retain(|(_, slices)| !slices.is_empty());
        if ranges.len() == 1 {
            let (start, slices) = ranges.pop().expect("one range");
            add_range(inputs, ring, (start, sign), slices);
            return Ok(());
        }
        std::thread::scope(|scope| {
            for (start, slices) in ranges {
                scope.spawn(move || add_range(inputs, ring, (start, sign), slices));
            }
        });
        Ok(())
    }

    /// Takes `other`'s sums (the same service's groups, of as many values) away, in `ring`
    /// (the layout's). A key service takes inputs it added ahead away from the streams
    /// themselves (`subtract_many`), without a second set of sums.
    pub fn subtract(&mut self, other: &MaskSums, ring: Ring) -> Result<(), MaskingError> {
        self.check_groups(other.sums.iter().map(|(group, _)| *group))?;
        for ((_, sum), (_, minus)) in self.sums.iter_mut().zip(&other.sums) {
            if sum.len() != minus.len() {
                return Err(MaskingError::Length {
                    expected: sum.len(),
                    got: minus.len(),
                });
            }
            for (value, taken) in sum.iter_mut().zip(minus) {
                *value = ring.reduce(value.wrapping_sub(*taken));
            }
        }
        Ok(())
    }

    fn check_groups(
        &self,
        groups: impl ExactSizeIterator<Item = usize>,
    ) -> Result<(), MaskingError> {
        if groups.len() != self.sums.len() || groups.zip(&self.sums).any(|(g, (h, _))| g != *h) {
            return Err(MaskingError::SeedsShape(self.service));
        }
        Ok(())
    }
}

/// Whether streams are added to the sums or taken away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sign {
    Add,
    Subtract,
}

/// Adds (or subtracts) values `start ..` of every input's group streams to `slices` (one per
/// group, each from value `start`), summing in a buffer of the ring's width.
fn add_range(
    inputs: &[StreamKeys],
    ring: Ring,
    (start, sign): (usize, Sign),
    slices: Vec<&mut [u64]>,
) {
    let width = ring.bytes();
    let mut keystream = Zeroizing::new(vec![0u8; STREAM_CHUNK * width]);
    for (index, slice) in slices.into_iter().enumerate() {
        match ring {
            Ring::Bits32 => {
                let mut sum = Zeroizing::new(vec![0u32; slice.len()]);
                for input in inputs {
                    let mut cipher = seeked(&input.keys[index].1, start, width);
                    for chunk in sum.chunks_mut(STREAM_CHUNK) {
                        let bytes = next_keystream(&mut cipher, &mut keystream, chunk.len() * 4);
                        for (value, word) in chunk.iter_mut().zip(bytes.chunks_exact(4)) {
                            *value = value.wrapping_add(u32::from_le_bytes(
                                word.try_into().expect("4 bytes"),
                            ));
                        }
                    }
                }
                for (out, value) in slice.iter_mut().zip(sum.iter()) {
                    *out = ring.reduce(match sign {
                        Sign::Add => out.wrapping_add(u64::from(*value)),
                        Sign::Subtract => out.wrapping_sub(u64::from(*value)),
                    });
                }
            }
            Ring::Bits64 if sign == Sign::Add => {
                for input in inputs {
                    let mut cipher = seeked(&input.keys[index].1, start, width);
                    for chunk in slice.chunks_mut(STREAM_CHUNK) {
                        let bytes = next_keystream(&mut cipher, &mut keystream, chunk.len() * 8);
                        ring.accumulate(chunk, bytes);
                    }
                }
            }
            Ring::Bits64 => {
                for input in inputs {
                    let mut cipher = seeked(&input.keys[index].1, start, width);
                    for chunk in slice.chunks_mut(STREAM_CHUNK) {
                        let bytes = next_keystream(&mut cipher, &mut keystream, chunk.len() * 8);
                        for (value, word) in chunk.iter_mut().zip(bytes.chunks_exact(8)) {
                            *value = value.wrapping_sub(u64::from_le_bytes(
                                word.try_into().expect("8 bytes"),
                            ));
                        }
                    }
                }
            }
        }
    }
}

/// A stream's cipher at value `start`.
fn seeked(key: &[u8; 16], start: usize, width: usize) -> Aes128Ctr {
    let mut cipher = Aes128Ctr::new(&(*key).into(), &[0u8; 16].into());
    cipher.seek((start * width) as u64);
    cipher
}

/// The cipher's next `len` bytes of keystream, in `buffer`.
fn next_keystream<'a>(cipher: &mut Aes128Ctr, buffer: &'a mut [u8], len: usize) -> &'a [u8] {
    let bytes = &mut buffer[..len];
    bytes.fill(0);
    cipher.apply_keystream(bytes);
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: &str = "5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a";
    const REF: &str = "00000000000000000000000000000000000000000000000000000000000000ff";

    fn context(reference: &str, values: usize) -> MaskContext<'_> {
        MaskContext::new("task", 3, reference, POLICY, values).unwrap()
    }

    /// `add_many` on any number of threads sums exactly what `add` of each input does, in both
    /// rings, with ranges that do not divide the values evenly.
    #[test]
    fn add_many_on_threads_equals_adding_each_input() {
        let layout = Layout::new(5, 3).unwrap();
        let service = 2;
        let groups = layout.groups_of(service);
        let values = 3 * STREAM_CHUNK + 5;
        let refs: Vec<String> = (0..4).map(|i| format!("{i:064x}")).collect();
        let seeds: Vec<Vec<(usize, Seed)>> = refs
            .iter()
            .map(|_| groups.iter().map(|g| (*g, Seed::random())).collect())
            .collect();
        for ring in [Ring::Bits32, Ring::Bits64] {
            let mut one_by_one = MaskSums::new(&layout, service, values).unwrap();
            for (reference, seeds) in refs.iter().zip(&seeds) {
                one_by_one
                    .add(seeds, &context(reference, values), ring)
                    .unwrap();
            }
            let keys: Vec<StreamKeys> = refs
                .iter()
                .zip(&seeds)
                .map(|(reference, seeds)| StreamKeys::of(seeds, &context(reference, values)))
                .collect();
            for threads in [1, 2, 3, 4, 9] {
                let mut at_once = MaskSums::new(&layout, service, values).unwrap();
                at_once
                    .add_split(&keys, ring, (threads, 1), Sign::Add)
                    .unwrap();
                assert_eq!(at_once, one_by_one, "{ring:?} on {threads} threads");
            }
            // Added on top of sums already held, as `add` would.
            let mut twice = one_by_one.clone();
            twice.add_split(&keys, ring, (2, 1), Sign::Add).unwrap();
            for (reference, seeds) in refs.iter().zip(&seeds) {
                one_by_one
                    .add(seeds, &context(reference, values), ring)
                    .unwrap();
            }
            assert_eq!(twice, one_by_one, "{ring:?} added twice");
        }
    }

    /// No values, or no inputs: nothing to add, and no panic.
    #[test]
    fn add_many_of_nothing_adds_nothing() {
        let layout = Layout::new(3, 2).unwrap();
        let mut empty = MaskSums::new(&layout, 1, 0).unwrap();
        let seeds: Vec<(usize, Seed)> = layout
            .groups_of(1)
            .into_iter()
            .map(|g| (g, Seed::random()))
            .collect();
        let keys = StreamKeys::of(&seeds, &context(REF, 0));
        assert_eq!(empty.add_many(&[keys], Ring::Bits32, 4), Ok(()));
        let mut sums = MaskSums::new(&layout, 1, 16).unwrap();
        assert_eq!(sums.add_many(&[], Ring::Bits64, 4), Ok(()));
        assert!(sums.sums.iter().all(|(_, sum)| sum.iter().all(|v| *v == 0)));
    }

    /// Keys of another length or of other groups are refused, not summed.
    #[test]
    fn add_many_refuses_keys_of_another_shape() {
        let layout = Layout::new(3, 2).unwrap();
        let mut sums = MaskSums::new(&layout, 1, 16).unwrap();
        let mine: Vec<(usize, Seed)> = layout
            .groups_of(1)
            .into_iter()
            .map(|g| (g, Seed::random()))
            .collect();
        let longer = StreamKeys::of(&mine, &context(REF, 17));
        assert_eq!(
            sums.add_many(&[longer], Ring::Bits32, 1),
            Err(MaskingError::Length {
                expected: 16,
                got: 17
            })
        );
        let theirs: Vec<(usize, Seed)> = layout
            .groups_of(2)
            .into_iter()
            .map(|g| (g, Seed::random()))
            .collect();
        let foreign = StreamKeys::of(&theirs, &context(REF, 16));
        assert_eq!(
            sums.add_many(&[foreign], Ring::Bits32, 1),
            Err(MaskingError::SeedsShape(1))
        );
    }

    /// Adding inputs a, b and c then subtracting c's sums gives a and b's sums, in both rings
    /// (wrapping where c's streams exceed the rest); sums of other groups or lengths are
    /// refused.
    #[test]
    fn subtracting_an_inputs_sums_leaves_the_others() {
        let layout = Layout::new(3, 2).unwrap();
        let values = STREAM_CHUNK + 3;
        let refs: Vec<String> = (0..3).map(|i| format!("{i:064x}")).collect();
        let keys = |reference: &String| {
            let seeds: Vec<(usize, Seed)> = layout
                .groups_of(1)
                .into_iter()
                .map(|g| (g, Seed::random()))
                .collect();
            StreamKeys::of(&seeds, &context(reference, values))
        };
        let all: Vec<StreamKeys> = refs.iter().map(keys).collect();
        for ring in [Ring::Bits32, Ring::Bits64] {
            let mut three = MaskSums::new(&layout, 1, values).unwrap();
            three.add_many(&all, ring, 2).unwrap();
            let mut last = MaskSums::new(&layout, 1, values).unwrap();
            last.add_many(&all[2..], ring, 1).unwrap();
            let mut first_two = MaskSums::new(&layout, 1, values).unwrap();
            first_two.add_many(&all[..2], ring, 1).unwrap();
            let mut in_place = three.clone();
            three.subtract(&last, ring).unwrap();
            assert_eq!(three, first_two, "{ring:?}");
            // The same in place, from the streams, on one and on several threads.
            for threads in [1, 3] {
                let mut taken = in_place.clone();
                taken
                    .add_split(&all[2..], ring, (threads, 1), Sign::Subtract)
                    .unwrap();
                assert_eq!(taken, first_two, "{ring:?}, {threads} threads");
            }
            in_place.subtract_many(&all[2..], ring, 2).unwrap();
            assert_eq!(in_place, first_two, "{ring:?}");
        }
        let mut sums = MaskSums::new(&layout, 1, values).unwrap();
        let other_service = MaskSums::new(&layout, 2, values).unwrap();
        assert_eq!(
            sums.subtract(&other_service, Ring::Bits32),
            Err(MaskingError::SeedsShape(1))
        );
        let shorter = MaskSums::new(&layout, 1, values - 1).unwrap();
        assert!(matches!(
            sums.subtract(&shorter, Ring::Bits32),
            Err(MaskingError::Length { .. })
        ));
    }
}
