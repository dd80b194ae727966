//! The two loops of the aggregation that touch every value: an update's float L2 norm, and its
//! quantization to the grid added into (or taken out of) the sum with the norm of what was
//! added. Each has a generic version and an AVX2 one chosen at run time; both give the same bits
//! for every input (checked below on values of every kind, lengths and offsets), so which CPU
//! aggregates never changes a sum, a norm or a clipping decision.

use super::accumulator::Update;

/// What the read-only pass learns of an update: its squared float L2 norm (not finite if any
/// value is not) and how many of its values are not zero (only those can round to a nonzero
/// integer, so they bound rounding's growth: `Accumulator::clip_factor`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Measure {
    pub(super) norm_squared: f64,
    pub(super) nonzero: u64,
}

/// An update measured: each tensor by a `NormMeter`, the tensors' norms added in schema order. A
/// streamed update is measured by the same meters fed chunk by chunk, so which path an update
/// takes never changes its measure (and so its clipping).
pub(super) fn measure(update: &Update<'_>) -> Measure {
    let mut meters = vec![NormMeter::default(); update.len()];
    for (meter, tensor) in meters.iter_mut().zip(update) {
        meter.feed(tensor);
    }
    NormMeter::total(&meters)
}

/// One tensor's squared L2 norm and count of nonzero values, fed in pieces of any size: value
/// `k` of the tensor goes to lane `k mod 8`, each lane is summed in the values' order and the
/// lanes at the end, so the bits depend on the values alone, not on where the pieces were cut
/// (a streamed update's chunks, or the whole tensor at once) nor on the CPU.
#[derive(Debug, Clone, Default)]
pub(super) struct NormMeter {
    lanes: [f64; 8],
    position: usize,
    nonzero: u64,
}

impl NormMeter {
    pub(super) fn feed(&mut self, bytes: &[u8]) {
        let values = bytes.len() / 4;
        // One at a time up to a multiple of eight, then whole eights, then the rest.
        let head = ((8 - self.position % 8) % 8).min(values);
        let body = (values - head) / 8 * 8;
        self.feed_singly(&bytes[..head * 4]);
        self.nonzero += feed_lanes(&mut self.lanes, &bytes[head * 4..(head + body) * 4]);
        self.position += body;
        self.feed_singly(&bytes[(head + body) * 4..values * 4]);
    }

    fn feed_singly(&mut self, bytes: &[u8]) {
        for b in bytes.chunks_exact(4) {
            let bits = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            let x = f64::from(f32::from_bits(bits));
            self.lanes[self.position % 8] += x * x;
            self.nonzero += u64::from(bits & ABS != 0);
            self.position += 1;
        }
    }

    fn norm_squared(&self) -> f64 {
        self.lanes.iter().sum()
    }

    /// The update's measure from its tensors' meters, the norms added in schema order.
    pub(super) fn total(meters: &[NormMeter]) -> Measure {
        Measure {
            norm_squared: meters
                .iter()
                .fold(0.0, |total, meter| total + meter.norm_squared()),
            nonzero: meters.iter().map(|meter| meter.nonzero).sum(),
        }
    }
}

/// An f32's bits without its sign: zero for +0 and -0 only.
const ABS: u32 = 0x7fff_ffff;

/// Adds the squares of whole eights of values to `lanes`, value `i` of each eight to lane `i`;
/// returns how many of the values are not zero.
fn feed_lanes(lanes: &mut [f64; 8], bytes: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above), the only requirement of the
        // `target_feature` function.
        return unsafe { feed_lanes_avx2(lanes, bytes) };
    }
    feed_lanes_generic(lanes, bytes)
}

/// `feed_lanes_generic` in AVX2 registers: lanes 0-3 and 4-7 in two vectors, each lane summed
/// in the same order with the same roundings, so the same bits. (The compiler's own
/// vectorization of the generic loop left most lanes in scalar adds.) Zeros are counted in
/// eight 32-bit counters, emptied into the total every 2^24 eights, long before they could wrap.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn feed_lanes_avx2(lanes: &mut [f64; 8], bytes: &[u8]) -> u64 {
    use std::arch::x86_64::{
        __m256i, _mm_loadu_ps, _mm256_add_pd, _mm256_and_si256, _mm256_cmpeq_epi32,
        _mm256_cvtps_pd, _mm256_loadu_pd, _mm256_loadu_si256, _mm256_mul_pd, _mm256_set1_epi32,
        _mm256_setzero_si256, _mm256_storeu_pd, _mm256_storeu_si256, _mm256_sub_epi32,
    };
    // SAFETY: `lanes` holds eight f64: two unaligned loads of four.
    let (mut low, mut high) = unsafe {
        (
            _mm256_loadu_pd(lanes.as_ptr()),
            _mm256_loadu_pd(lanes.as_ptr().add(4)),
        )
    };
    let abs = _mm256_set1_epi32(ABS as i32);
    let mut zeros = 0u64;
    for block in bytes.chunks(32 << 24) {
        let mut counters = _mm256_setzero_si256();
        for chunk in block.chunks_exact(32) {
            // SAFETY: `chunk` is 32 bytes: two unaligned loads of four f32 (little-endian, as
            // x86 is) and one of all eight as 32-bit integers read inside it.
            let (x_low, x_high, bits) = unsafe {
                (
                    _mm256_cvtps_pd(_mm_loadu_ps(chunk.as_ptr().cast())),
                    _mm256_cvtps_pd(_mm_loadu_ps(chunk.as_ptr().add(16).cast())),
                    _mm256_loadu_si256(chunk.as_ptr().cast::<__m256i>()),
                )
            };
            low = _mm256_add_pd(low, _mm256_mul_pd(x_low, x_low));
            high = _mm256_add_pd(high, _mm256_mul_pd(x_high, x_high));
            // -1 in each lane whose value is +0 or -0; subtracting counts it.
            let zero = _mm256_cmpeq_epi32(_mm256_and_si256(bits, abs), _mm256_setzero_si256());
            counters = _mm256_sub_epi32(counters, zero);
        }
        let mut counts = [0u32; 8];
        // SAFETY: `counts` holds eight u32: one unaligned store of eight.
        unsafe { _mm256_storeu_si256(counts.as_mut_ptr().cast::<__m256i>(), counters) };
        zeros += counts.iter().map(|&c| u64::from(c)).sum::<u64>();
    }
    // SAFETY: as for the loads.
    unsafe {
        _mm256_storeu_pd(lanes.as_mut_ptr(), low);
        _mm256_storeu_pd(lanes.as_mut_ptr().add(4), high);
    }
    (bytes.len() / 32 * 8) as u64 - zeros
}

#[inline(always)]
fn feed_lanes_generic(lanes: &mut [f64; 8], bytes: &[u8]) -> u64 {
    let mut nonzero = 0u64;
    for chunk in bytes.chunks_exact(32) {
        for (lane, sum) in lanes.iter_mut().enumerate() {
            let b = &chunk[lane * 4..lane * 4 + 4];
            let bits = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            let x = f64::from(f32::from_bits(bits));
            *sum += x * x;
            nonzero += u64::from(bits & ABS != 0);
        }
    }
    nonzero
}

/// 1.5 * 2^52: adding it to |x| < 2^51 rounds x to the nearest integer (ties to even) in the
/// low mantissa bits, so the integer is the bit pattern minus the constant's. Unlike `round()`,
/// which is a libm call without SSE4.1, this vectorizes on every x86-64.
const ROUNDING: f64 = 6_755_399_441_055_744.0;

/// What `add_quantized` does with the quantized values: adds them to the sum, subtracts them, or
/// (`DRY`) does every step of adding them, loads and stores included, with the values masked to
/// zero by a mask the compiler cannot see through: an update that must add nothing (a
/// non-finite one) then costs what an added one does.
pub(super) const ADD: u8 = 0;
pub(super) const SUBTRACT: u8 = 1;
pub(super) const DRY: u8 = 2;

/// One stripe's slice of the update: quantize, add (or subtract, or neither: `OP`), and the
/// squared norm of the integers added. The float norm was measured before, in a read-only pass
/// (`measure`), buffered or streamed. On x86-64 with AVX2 (detected at run time)
/// `add_quantized_avx2` runs: the arithmetic, and so every result bit, is the same either way
/// (no fused multiply-add is used: each operation rounds exactly as in the generic loop).
#[inline]
pub(super) fn add_quantized<const OP: u8>(target: &mut [i64], bytes: &[u8], units: f64) -> f64 {
    #[cfg(test)]
    if OP == DRY {
        tests::DRY_VALUES.with(|count| count.set(count.get() + bytes.len() / 4));
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above), the only requirement of the
        // `target_feature` function.
        return unsafe { add_quantized_avx2::<OP>(target, bytes, units) };
    }
    add_quantized_generic::<OP>(target, bytes, units)
}

/// `add_quantized_generic` in AVX2 registers: each eight values as two vectors of four (lanes
/// 0-3 and 4-7), every operation the generic loop's, in its order, with no fused multiply-add:
/// the same integers and the same norm bits. (The compiler's own vectorization of the generic
/// loop left the norm's lanes in scalar adds and shuffles, most of the loop's time.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn add_quantized_avx2<const OP: u8>(target: &mut [i64], bytes: &[u8], units: f64) -> f64 {
    use std::arch::x86_64::{
        __m256d, __m256i, _mm_loadu_ps, _mm256_add_epi64, _mm256_add_pd, _mm256_and_si256,
        _mm256_castpd_si256, _mm256_cvtps_pd, _mm256_loadu_si256, _mm256_mul_pd,
        _mm256_set1_epi64x, _mm256_set1_pd, _mm256_setzero_pd, _mm256_storeu_pd,
        _mm256_storeu_si256, _mm256_sub_epi64, _mm256_sub_pd,
    };
    let mask = _mm256_set1_epi64x(dry_mask::<OP>());
    let units_v = _mm256_set1_pd(units);
    let rounding = _mm256_set1_pd(ROUNDING);
    let rounding_bits = _mm256_set1_epi64x(ROUNDING.to_bits() as i64);
    let zero = _mm256_setzero_pd();
    let mut squares: [__m256d; 2] = [zero; 2];
    let mut targets = target.chunks_exact_mut(8);
    let mut values = bytes.chunks_exact(32);
    for (slots, chunk) in (&mut targets).zip(&mut values) {
        for (half, squares) in squares.iter_mut().enumerate() {
            // SAFETY: `chunk` is 32 bytes and `slots` eight i64: the loads and the store of
            // half `half` (four f32 at byte 16 * half, four i64 at slot 4 * half) stay inside
            // them, unaligned.
            let (x, sum) = unsafe {
                (
                    _mm256_cvtps_pd(_mm_loadu_ps(chunk.as_ptr().add(16 * half).cast())),
                    _mm256_loadu_si256(slots.as_ptr().add(4 * half).cast::<__m256i>()),
                )
            };
            let r = _mm256_add_pd(_mm256_mul_pd(x, units_v), rounding);
            let q = _mm256_sub_epi64(_mm256_castpd_si256(r), rounding_bits);
            let sum = match OP {
                SUBTRACT => _mm256_sub_epi64(sum, q),
                DRY => _mm256_add_epi64(sum, _mm256_and_si256(q, mask)),
                _ => _mm256_add_epi64(sum, q),
            };
            // SAFETY: as for the load above.
            unsafe { _mm256_storeu_si256(slots.as_mut_ptr().add(4 * half).cast::<__m256i>(), sum) };
            let rounded = _mm256_sub_pd(r, rounding);
            *squares = _mm256_add_pd(*squares, _mm256_mul_pd(rounded, rounded));
        }
    }
    let tail = quantized_tail::<OP>(targets.into_remainder(), values.remainder(), units);
    let mut square_lanes = [0f64; 8];
    // SAFETY: the array holds eight f64: two unaligned stores of four.
    unsafe {
        _mm256_storeu_pd(square_lanes.as_mut_ptr(), squares[0]);
        _mm256_storeu_pd(square_lanes.as_mut_ptr().add(4), squares[1]);
    }
    square_lanes.iter().sum::<f64>() + tail
}

/// The loop itself, in eight independent lanes so it vectorizes. Values beyond 2^51 grid units
/// (or not finite) give meaningless integers, but the same ones on the way back; they reach
/// only the dry pass (a non-finite update), where they are masked, since a measured update's
/// scale keeps every value within 2^16 units.
#[inline(always)]
fn add_quantized_generic<const OP: u8>(target: &mut [i64], bytes: &[u8], units: f64) -> f64 {
    let rounding_bits = ROUNDING.to_bits() as i64;
    let mask = dry_mask::<OP>();
    let mut squares = [0f64; 8];
    let mut targets = target.chunks_exact_mut(8);
    let mut values = bytes.chunks_exact(32);
    for (slots, chunk) in (&mut targets).zip(&mut values) {
        for lane in 0..8 {
            let b = &chunk[lane * 4..lane * 4 + 4];
            let x = f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            let r = x * units + ROUNDING;
            let q = (r.to_bits() as i64).wrapping_sub(rounding_bits);
            slots[lane] = apply_one::<OP>(slots[lane], q, mask);
            let rounded = r - ROUNDING;
            squares[lane] += rounded * rounded;
        }
    }
    let tail = quantized_tail::<OP>(targets.into_remainder(), values.remainder(), units);
    squares.iter().sum::<f64>() + tail
}

/// The values after the last whole eight, one at a time: the squared norm of what they added.
#[inline(always)]
fn quantized_tail<const OP: u8>(target: &mut [i64], bytes: &[u8], units: f64) -> f64 {
    let rounding_bits = ROUNDING.to_bits() as i64;
    let mask = dry_mask::<OP>();
    let mut tail = 0.0;
    for (slot, b) in target.iter_mut().zip(bytes.chunks_exact(4)) {
        let x = f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        let r = x * units + ROUNDING;
        let q = (r.to_bits() as i64).wrapping_sub(rounding_bits);
        *slot = apply_one::<OP>(*slot, q, mask);
        let rounded = r - ROUNDING;
        tail += rounded * rounded;
    }
    tail
}

/// All ones, or for `DRY` zero, from a value the compiler cannot see through (so it keeps every
/// step of the add).
#[inline(always)]
fn dry_mask<const OP: u8>() -> i64 {
    if OP == DRY {
        std::hint::black_box(0)
    } else {
        -1
    }
}

/// One slot of the sum after `OP` with the quantized value `q`.
#[inline(always)]
fn apply_one<const OP: u8>(slot: i64, q: i64, mask: i64) -> i64 {
    match OP {
        SUBTRACT => slot.wrapping_sub(q),
        DRY => slot.wrapping_add(q & mask),
        _ => slot.wrapping_add(q),
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    thread_local! {
        /// Values this thread passed through a dry add (`DRY`), for tests that the pass ran.
        pub(in crate::aggregate) static DRY_VALUES: std::cell::Cell<usize> =
            const { std::cell::Cell::new(0) };
    }

    /// Values of every kind: small and large, both signs, zeros, halves that round to even,
    /// beyond the grid's exact range, and (with `non_finite`) infinities and NaN.
    fn values(len: usize, seed: u64, non_finite: bool) -> Vec<u8> {
        let mut state = seed;
        (0..len)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let uniform = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                match i % 11 {
                    0 => uniform * 1e6,
                    1 => -0.0,
                    2 => 0.5,
                    3 => -2.5,
                    4 if non_finite => f32::INFINITY,
                    5 if non_finite => f32::NAN,
                    6 => f32::MAX,
                    7 => f32::MIN_POSITIVE / 8.0,
                    _ => uniform,
                }
            })
            .flat_map(f32::to_le_bytes)
            .collect()
    }

    /// Finite values whose squares span many exponents, so every lane's running sum rounds and
    /// a change in the order lanes are added (within or across them) changes the bits.
    fn mixed(len: usize, seed: u64) -> Vec<u8> {
        let mut state = seed;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let mantissa = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                mantissa * 2f32.powi((state % 40) as i32 - 20)
            })
            .flat_map(f32::to_le_bytes)
            .collect()
    }

    /// Runs both loops on a copy of `start`, and compares every bit.
    fn compare<const OP: u8>(start: &[i64], bytes: &[u8], units: f64, case: &str) {
        let (mut generic, mut avx2) = (start.to_vec(), start.to_vec());
        let expected = add_quantized_generic::<OP>(&mut generic, bytes, units);
        // SAFETY: the caller checked that the CPU supports AVX2.
        let got = unsafe { add_quantized_avx2::<OP>(&mut avx2, bytes, units) };
        assert_eq!(generic, avx2, "sums, {case}");
        assert_eq!(expected.to_bits(), got.to_bits(), "integer norm, {case}");
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_avx2_loops_give_the_generic_loops_bits() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let inputs = [
            (0, values(0, 1, false)),
            (5, values(5, 2, false)),
            (8, values(8, 3, false)),
            (263, values(263, 4, false)),
            (1000, values(1000, 5, true)),
            (1003, mixed(1003, 6)),
            (4096, mixed(4096, 7)),
        ];
        for (len, bytes) in &inputs {
            for units in [1.0, 4096.0, 1.0e-3, 3.7e9] {
                let start: Vec<i64> = (0..*len as i64).map(|i| i * 1_000_003 - 7).collect();
                let case = format!("{len} values at {units}");
                compare::<ADD>(&start, bytes, units, &case);
                compare::<SUBTRACT>(&start, bytes, units, &case);
                compare::<DRY>(&start, bytes, units, &case);
                let mut sum = start.clone();
                let added = add_quantized_generic::<ADD>(&mut sum, bytes, units);
                add_quantized_generic::<SUBTRACT>(&mut sum, bytes, units);
                assert_eq!(
                    sum, start,
                    "adding then subtracting restores the sum, {case}"
                );
                let dry = add_quantized_generic::<DRY>(&mut sum, bytes, units);
                assert_eq!(sum, start, "a dry add changes nothing, {case}");
                assert_eq!(dry.to_bits(), added.to_bits(), "a dry add's norm, {case}");
            }
            // The norm's lanes, from a start that is not zero.
            let (mut generic, mut avx2) = ([0.5f64; 8], [0.5f64; 8]);
            let whole = &bytes[..bytes.len() / 32 * 32];
            let nonzero = feed_lanes_generic(&mut generic, whole);
            // SAFETY: as above.
            let avx2_nonzero = unsafe { feed_lanes_avx2(&mut avx2, whole) };
            assert_eq!(nonzero, avx2_nonzero, "nonzero values, {len}");
            let counted = whole
                .chunks_exact(4)
                .filter(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) != 0.0)
                .count();
            assert_eq!(nonzero, counted as u64, "nonzero values, {len}");
            assert_eq!(
                generic.map(f64::to_bits),
                avx2.map(f64::to_bits),
                "lanes, {len}"
            );
        }
    }

    /// What lets an update take either path: a tensor measured whole or in pieces cut anywhere
    /// (as a streamed update's chunks cut it) gives the same bits.
    #[test]
    fn a_tensor_measured_in_pieces_cut_anywhere_gives_the_bits_of_it_measured_whole() {
        let bytes = mixed(4099, 9);
        let mut whole = NormMeter::default();
        whole.feed(&bytes);
        let expected = NormMeter::total(&[whole]);
        for cuts in [
            vec![4],
            vec![12, 28],
            vec![3 * 4, 7 * 4, 1000 * 4],
            vec![4096 * 4],
        ] {
            let mut meter = NormMeter::default();
            let mut from = 0;
            for &cut in cuts.iter().chain([&bytes.len()]) {
                meter.feed(&bytes[from..cut]);
                from = cut;
            }
            let measured = NormMeter::total(&[meter]);
            assert_eq!(
                measured.norm_squared.to_bits(),
                expected.norm_squared.to_bits(),
                "{cuts:?}"
            );
            assert_eq!(measured.nonzero, expected.nonzero, "{cuts:?}");
        }
    }

    #[test]
    fn the_mixed_values_make_the_norms_depend_on_the_order_of_their_additions() {
        // What makes the comparison above sensitive: summed in another order (lanes one after
        // the other instead of interleaved), the same squares give other bits.
        let bytes = mixed(4096, 7);
        let squares: Vec<f64> = bytes
            .chunks_exact(4)
            .map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])).powi(2))
            .collect();
        let update: [&[u8]; 1] = [&bytes];
        let in_lanes = measure(&update).norm_squared;
        let in_order: f64 = squares.iter().sum();
        assert_ne!(in_lanes.to_bits(), in_order.to_bits());
    }
}
