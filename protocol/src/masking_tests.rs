//! Masked rounds' arithmetic: the layouts' coverage (any q key services hold every seed, any q - 1
//! miss one), exact cancellation over the included inputs, a withheld, disagreeing or wrong mask
//! sum failing the unmask, and the enclave's view of a masked update uniform on the grid even to
//! q - 1 key services.

use super::*;
use crate::hpke::generate_keypair;

const TASK: &str = "task-1";
/// The policy hash the tests' contexts name.
const POLICY: &str = "5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c";

fn context(assignment: usize, values: usize) -> MaskContext<'static> {
    let assignment_ref: &'static str = Box::leak(format!("{assignment:064x}").into_boxed_str());
    MaskContext::new(TASK, 3, assignment_ref, POLICY, values).unwrap()
}

/// SplitMix64: test data, not masks.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A clipped update on the grid: values within +-2^16 with an L2 norm of at most 2^16.
fn update(device: usize, values: usize) -> Vec<i64> {
    let raw: Vec<i64> = (0..values)
        .map(|i| (mix((device * 100_003 + i) as u64) % 2001) as i64 - 1000)
        .collect();
    let norm = raw.iter().map(|v| (v * v) as f64).sum::<f64>().sqrt();
    let scale = (65536.0 / norm).min(1.0);
    raw.iter().map(|v| (*v as f64 * scale) as i64).collect()
}

fn seeds(layout: &Layout) -> Vec<Seed> {
    layout.groups().iter().map(|_| Seed::random()).collect()
}

/// Every subset of `1..=n` of `size` members.
fn subsets(n: u8, size: u8) -> Vec<Vec<u8>> {
    (0u32..1 << n)
        .filter(|mask| mask.count_ones() == u32::from(size))
        .map(|mask| (1..=n).filter(|s| mask & (1 << (s - 1)) != 0).collect())
        .collect()
}

#[test]
fn the_quorum_is_the_release_quorum() {
    for (n, t, q) in [
        (1, 1, 1),
        (2, 2, 2),
        (3, 2, 3),
        (3, 3, 3),
        (4, 2, 3),
        (5, 3, 4),
        (7, 3, 5),
    ] {
        assert_eq!(quorum(n, t), q, "n {n}, t {t}");
    }
}

#[test]
fn any_quorum_of_key_services_holds_every_seed_and_any_fewer_miss_one() {
    for n in 1..=7u8 {
        for t in 1..=n {
            let layout = Layout::new(n, t).unwrap();
            let q = layout.quorum();
            let size = usize::from(n - q + 1);
            let expected = subsets(n, n - q + 1).len();
            assert_eq!(layout.groups().len(), expected, "n {n}, t {t}");
            assert!(layout.groups().iter().all(|g| g.len() == size));
            for services in subsets(n, q) {
                assert!(layout.covers(&services), "n {n} t {t}: {services:?}");
            }
            if q > 1 {
                for services in subsets(n, q - 1) {
                    assert!(!layout.covers(&services), "n {n} t {t}: {services:?}");
                }
            }
        }
    }
    // A handful of seeds for the layouts confed runs.
    assert_eq!(Layout::new(3, 2).unwrap().groups().len(), 3);
    assert_eq!(Layout::new(5, 3).unwrap().groups().len(), 10);
    assert_eq!(Layout::new(7, 3).unwrap().groups().len(), 35);
}

#[test]
fn a_layout_outside_the_bounds_is_refused() {
    for (n, t) in [(3, 0), (3, 4), (8, 3)] {
        assert_eq!(Layout::new(n, t), Err(MaskingError::Layout { n, t }));
    }
}

/// The included devices with their sealed seeds.
type Included = Vec<(usize, Vec<SealedSeeds>)>;

struct Round {
    layout: Layout,
    keys: Vec<(PrivateKey, PublicKey)>,
    values: usize,
}

impl Round {
    fn new(n: u8, t: u8, values: usize) -> Self {
        Self {
            layout: Layout::new(n, t).unwrap(),
            keys: (0..n).map(|_| generate_keypair()).collect(),
            values,
        }
    }

    /// Device `d`'s masked update and its seeds sealed to every key service.
    fn device(&self, d: usize) -> (Vec<u64>, Vec<SealedSeeds>) {
        let ctx = context(d, self.values);
        let seeds = seeds(&self.layout);
        let masked = mask(&self.layout, &update(d, self.values), &seeds, &ctx).unwrap();
        let public: Vec<PublicKey> = self.keys.iter().map(|(_, p)| *p).collect();
        let sealed = seal_seeds(&self.layout, &seeds, &public, &ctx).unwrap();
        (masked, sealed)
    }

    /// Key service `service`'s mask sums over the included devices.
    fn answer(&self, service: u8, included: &[(usize, Vec<SealedSeeds>)]) -> MaskSums {
        let mut sums = MaskSums::new(&self.layout, service, self.values).unwrap();
        let private = &self.keys[usize::from(service) - 1].0;
        for (d, sealed) in included {
            let ctx = context(*d, self.values);
            let mine = &sealed[usize::from(service) - 1];
            let seeds = open_seeds(&self.layout, private, mine, &ctx).unwrap();
            sums.add(&seeds, &ctx, self.layout.ring()).unwrap();
        }
        sums
    }
}

/// Six devices of which five are included; returns the round, the masked sum of the included,
/// their seeds, and the exact sum of their updates.
fn five_of_six(n: u8, t: u8) -> (Round, Vec<u64>, Included, Vec<i64>) {
    five_of_six_in(n, t, Ring::Bits64)
}

fn five_of_six_in(n: u8, t: u8, ring: Ring) -> (Round, Vec<u64>, Included, Vec<i64>) {
    let mut r = Round::new(n, t, 1000);
    r.layout = r.layout.with_ring(ring);
    let mut masked_sum = vec![0u64; r.values];
    let mut exact = vec![0i64; r.values];
    let mut included = Vec::new();
    for d in 0..6 {
        let (masked, sealed) = r.device(d);
        if d == 4 {
            continue; // excluded by the enclave: its masks must not be removed either
        }
        for (i, v) in masked.iter().enumerate() {
            masked_sum[i] = masked_sum[i].wrapping_add(*v);
        }
        for (i, v) in update(d, r.values).iter().enumerate() {
            exact[i] += v;
        }
        included.push((d, sealed));
    }
    (r, masked_sum, included, exact)
}

#[test]
fn the_included_inputs_masks_cancel_exactly_with_any_quorum_answering() {
    for (n, t) in [(3, 2), (5, 3), (4, 2)] {
        let (r, masked_sum, included, exact) = five_of_six(n, t);
        let q = r.layout.quorum();
        for answering in subsets(n, q) {
            let answers: Vec<MaskSums> =
                answering.iter().map(|s| r.answer(*s, &included)).collect();
            let unmasked = unmask(
                &r.layout,
                &masked_sum,
                &answers,
                5,
                1 << 16,
                NoiseRoom::default(),
            )
            .unwrap();
            assert_eq!(*unmasked, exact, "n {n}, t {t}, answering {answering:?}");
        }
        // Every service answering: the holders of each group agree.
        let answers: Vec<MaskSums> = (1..=n).map(|s| r.answer(s, &included)).collect();
        assert_eq!(
            *unmask(
                &r.layout,
                &masked_sum,
                &answers,
                5,
                1 << 16,
                NoiseRoom::default()
            )
            .unwrap(),
            exact
        );
    }
}

#[test]
fn too_few_key_services_answering_withholds_a_group_and_fails() {
    let (r, masked_sum, included, _) = five_of_six(5, 3);
    let answers: Vec<MaskSums> = [1, 2, 3].iter().map(|s| r.answer(*s, &included)).collect();
    match unmask(
        &r.layout,
        &masked_sum,
        &answers,
        5,
        1 << 16,
        NoiseRoom::default(),
    ) {
        Err(MaskingError::Withheld { members, .. }) => assert_eq!(members, vec![4, 5]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_wrong_mask_sum_fails_the_unmask_rather_than_releasing_garbage() {
    // Two holders of each group (n 5, t 3): a sum off by one disagrees with the other holder's.
    let (r, masked_sum, included, _) = five_of_six(5, 3);
    let mut answers: Vec<MaskSums> = (1..=5).map(|s| r.answer(s, &included)).collect();
    answers[0].sums[0].1[7] += 1;
    assert!(matches!(
        unmask(
            &r.layout,
            &masked_sum,
            &answers,
            5,
            1 << 16,
            NoiseRoom::default()
        ),
        Err(MaskingError::Disagree { group: 0, .. })
    ));
    // One holder of each group (n 3, t 2): a mask sum over other inputs (here, one input
    // left out) leaves a stream in the sum, spread over all of 2^64: out of bound.
    let (r, masked_sum, included, _) = five_of_six(3, 2);
    let mut answers: Vec<MaskSums> = (1..=3).map(|s| r.answer(s, &included)).collect();
    answers[1] = r.answer(2, &included[1..]);
    assert_eq!(
        unmask(
            &r.layout,
            &masked_sum,
            &answers,
            5,
            1 << 16,
            NoiseRoom::default()
        ),
        Err(MaskingError::OutOfBound {
            included: 5,
            units_per_clip: 1 << 16,
            noise_norm: 0,
        })
    );
    // The same wrong sum with room for distributed noise of a realistic scale (3 groups of
    // variance 2^32 on these values): still spread over 2^64, still out of bound.
    let room = NoiseRoom::of(masked_sum.len(), 1 << 32, 3);
    assert!(matches!(
        unmask(&r.layout, &masked_sum, &answers, 5, 1 << 16, room),
        Err(MaskingError::OutOfBound { .. })
    ));
}

/// Pearson's chi-square of the bytes of `values` against uniform (255 degrees of freedom: above
/// 341 happens with probability 0.0002).
fn chi_square_of_bytes(values: &[u64]) -> f64 {
    chi_square_of_low_bytes(values, 8)
}

/// The same over each value's low `width` bytes (a ring of 2^(8 width)).
fn chi_square_of_low_bytes(values: &[u64], width: usize) -> f64 {
    let mut counts = [0u64; 256];
    for v in values {
        for b in &v.to_le_bytes()[..width] {
            counts[usize::from(*b)] += 1;
        }
    }
    let expected = (values.len() * width) as f64 / 256.0;
    counts
        .iter()
        .map(|c| (*c as f64 - expected).powi(2) / expected)
        .sum()
}

#[test]
fn a_masked_update_is_uniform_on_the_grid_even_to_q_minus_1_key_services() {
    // n 5, t 3: q 4. The attacker holds the enclave and key services 1, 2 and 3, so it knows
    // every seed but the group {4, 5}'s, and removes every stream it knows.
    let layout = Layout::new(5, 3).unwrap();
    let values = 1 << 15;
    let spike: Vec<i64> = (0..values)
        .map(|i| if i == 0 { 1 << 16 } else { 0 })
        .collect();
    let zero = vec![0i64; values];
    let attacker = [1u8, 2, 3];
    for (name, grid) in [("spike", &spike), ("zero", &zero)] {
        let ctx = context(9, values);
        let seeds = seeds(&layout);
        let masked = mask(&layout, grid, &seeds, &ctx).unwrap();
        // What the attacker removes: the streams of every group one of its services holds.
        let mut view = masked.clone();
        for (group, members) in layout.groups().iter().enumerate() {
            if members.iter().any(|m| attacker.contains(m)) {
                let mut stream = vec![0u64; values];
                add_stream(&seeds[group], &ctx, group, &mut stream, Ring::Bits64).unwrap();
                for (v, s) in view.iter_mut().zip(&stream) {
                    *v = v.wrapping_sub(*s);
                }
            }
        }
        // All that is left is the update plus the one stream it cannot know: uniform bytes,
        // and the update's own coordinate no different from the others.
        for (what, values) in [("masked", &masked), ("attacker's view", &view)] {
            let chi = chi_square_of_bytes(values);
            assert!(chi < 341.0, "{name}, {what}: chi-square {chi}");
            let high_bits = values.iter().filter(|v| **v >> 63 == 1).count() as f64;
            let share = high_bits / values.len() as f64;
            assert!(
                (share - 0.5).abs() < 0.02,
                "{name}, {what}: top bit set {share}"
            );
        }
        // Knowing the missing group's seed too (q services) leaves exactly the update.
        let mut stream = vec![0u64; values];
        let missing = layout
            .groups()
            .iter()
            .position(|g| g == &vec![4, 5])
            .unwrap();
        add_stream(&seeds[missing], &ctx, missing, &mut stream, Ring::Bits64).unwrap();
        let clear: Vec<i64> = view
            .iter()
            .zip(&stream)
            .map(|(v, s)| v.wrapping_sub(*s) as i64)
            .collect();
        assert_eq!(&clear, grid, "{name}");
    }
}

#[test]
fn streams_are_deterministic_and_differ_by_group_input_round_and_length() {
    let seed = Seed::from_bytes([7; SEED_BYTES]);
    let stream = |ctx: &MaskContext<'_>, group: usize| {
        let mut out = vec![0u64; ctx.values()];
        add_stream(&seed, ctx, group, &mut out, Ring::Bits64).unwrap();
        out
    };
    let base = context(1, 64);
    assert_eq!(stream(&base, 0), stream(&base, 0));
    let others = [
        stream(&base, 1),
        stream(&context(2, 64), 0),
        stream(
            &MaskContext::new(TASK, 4, &format!("{:064x}", 1), POLICY, 64).unwrap(),
            0,
        ),
        stream(&context(1, 65), 0)[..64].to_vec(),
    ];
    for other in others {
        assert_ne!(other, stream(&base, 0));
    }
    // A stream longer than one keystream chunk is the same stream, continued.
    let long = stream(&context(1, STREAM_CHUNK * 2 + 3), 0);
    assert_eq!(long.len(), STREAM_CHUNK * 2 + 3);
    assert_ne!(long[STREAM_CHUNK], long[0]);
}

#[test]
fn sealed_seeds_open_only_for_their_key_service_and_input() {
    let r = Round::new(3, 2, 16);
    let (_, sealed) = r.device(1);
    let ctx = context(1, 16);
    let mine = open_seeds(&r.layout, &r.keys[0].0, &sealed[0], &ctx).unwrap();
    assert_eq!(mine.len(), r.layout.groups_of(1).len());
    // Another service's key, another input's context, or a service number moved.
    assert!(open_seeds(&r.layout, &r.keys[1].0, &sealed[0], &ctx).is_err());
    assert!(open_seeds(&r.layout, &r.keys[0].0, &sealed[0], &context(2, 16)).is_err());
    let moved = SealedSeeds {
        service: 2,
        ..sealed[0].clone()
    };
    assert!(open_seeds(&r.layout, &r.keys[1].0, &moved, &ctx).is_err());
    assert_eq!(
        open_seeds(
            &r.layout,
            &r.keys[0].0,
            &SealedSeeds {
                service: 4,
                ..sealed[0].clone()
            },
            &ctx
        )
        .err(),
        Some(MaskingError::NoSuchService(4))
    );
}

#[test]
fn a_device_must_bring_one_seed_per_group() {
    let layout = Layout::new(5, 3).unwrap();
    let ctx = context(1, 4);
    assert_eq!(
        mask(&layout, &[1, 2, 3, 4], &[Seed::random()], &ctx),
        Err(MaskingError::Seeds {
            expected: 10,
            got: 1
        })
    );
}

#[test]
fn a_masked_update_reads_back_only_at_its_length_and_name() {
    let values = vec![1u64, u64::MAX, 1 << 40];
    let encoded = encode_masked(&values, Ring::Bits64);
    let read = read_masked(&encoded, 3, Ring::Bits64).unwrap();
    let back: Vec<u64> = read
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(back, values);
    assert_eq!(
        read_masked(&encoded, 4, Ring::Bits64),
        Err(MaskedProblem::Shape(4))
    );
    assert!(matches!(
        read_masked(b"not safetensors", 3, Ring::Bits64),
        Err(MaskedProblem::Format(_))
    ));
}

#[test]
fn a_context_whose_fields_could_hold_the_separator_is_refused() {
    let reference = "ab".repeat(32);
    assert!(MaskContext::new("task-1", 1, &reference, POLICY, 4).is_ok());
    for (task, assignment_ref) in [
        ("t\u{0}5", reference.as_str()),
        ("", reference.as_str()),
        ("task-1", "AB"),
        ("task-1", &"Ab".repeat(32)),
        (&"t".repeat(65), reference.as_str()),
    ] {
        assert_eq!(
            MaskContext::new(task, 1, assignment_ref, POLICY, 4),
            Err(MaskingError::Context),
            "{task:?} {assignment_ref:?}"
        );
    }
}

#[test]
fn a_vector_of_another_length_than_its_context_is_refused() {
    let layout = Layout::new(3, 2).unwrap();
    let ctx = context(1, 4);
    let seeds = seeds(&layout);
    assert_eq!(
        mask(&layout, &[1, 2, 3], &seeds, &ctx),
        Err(MaskingError::Length {
            expected: 4,
            got: 3
        })
    );
    let mut out = vec![0u64; 5];
    assert!(add_stream(&seeds[0], &ctx, 0, &mut out, Ring::Bits64).is_err());
}

#[test]
fn an_answer_from_outside_the_layout_or_twice_fails_the_unmask() {
    let (r, masked_sum, included, _) = five_of_six(3, 2);
    let mut answers: Vec<MaskSums> = (1..=3).map(|s| r.answer(s, &included)).collect();
    answers.push(answers[0].clone());
    assert_eq!(
        unmask(
            &r.layout,
            &masked_sum,
            &answers,
            5,
            1 << 16,
            NoiseRoom::default()
        ),
        Err(MaskingError::DuplicateAnswer(1))
    );
    answers.pop();
    answers[2].service = 9;
    assert_eq!(
        unmask(
            &r.layout,
            &masked_sum,
            &answers,
            5,
            1 << 16,
            NoiseRoom::default()
        ),
        Err(MaskingError::NoSuchService(9))
    );
}

#[test]
fn in_the_ring_of_2_32_masks_cancel_exactly_and_a_masked_update_is_uniform_in_32_bits() {
    for (n, t) in [(3, 2), (5, 3)] {
        let (r, masked_sum, included, exact) = five_of_six_in(n, t, Ring::Bits32);
        let answers: Vec<MaskSums> = (1..=n).map(|s| r.answer(s, &included)).collect();
        assert!(
            answers.iter().all(|a| a
                .sums
                .iter()
                .all(|(_, sum)| sum.iter().all(|v| *v < 1 << 32))),
            "sums are reduced"
        );
        let unmasked = unmask(
            &r.layout,
            &masked_sum,
            &answers,
            5,
            1 << 16,
            NoiseRoom::default(),
        )
        .unwrap();
        assert_eq!(*unmasked, exact, "n {n}, t {t}");
    }
    let layout = Layout::new(3, 2).unwrap().with_ring(Ring::Bits32);
    let values = 1 << 15;
    let spike: Vec<i64> = (0..values)
        .map(|i| if i == 0 { -(1 << 16) } else { 0 })
        .collect();
    let ctx = context(9, values);
    // Fixed seeds: the statistic is a fixed number, and the test cannot flake.
    let fixed: Vec<Seed> = (0..3u8).map(|g| Seed::from_bytes([g + 40; 32])).collect();
    let masked = mask(&layout, &spike, &fixed, &ctx).unwrap();
    assert!(masked.iter().all(|v| *v < 1 << 32));
    // 255 degrees of freedom: the 1e-6 tail is at 377.
    let chi = chi_square_of_low_bytes(&masked, 4);
    assert!(chi < 377.0, "chi-square {chi}");
    // The wire holds 4 bytes a value, and reads back.
    let encoded = encode_masked(&masked, Ring::Bits32);
    let data = read_masked(&encoded, values, Ring::Bits32).unwrap();
    assert_eq!(data.len(), 4 * values);
    assert_eq!(Ring::Bits32.values(data), masked);
    assert!(read_masked(&encoded, values, Ring::Bits64).is_err());
}

#[test]
fn the_ring_of_2_32_holds_a_sum_only_below_2_31_with_its_noise() {
    let units = 1u64 << 16;
    assert!(Ring::Bits32.holds(32_767, units, 0.0));
    assert!(!Ring::Bits32.holds(32_768, units, 0.0));
    assert!(Ring::Bits32.holds(30_000, units, 2767.0 * 65536.0 - 1.0));
    assert!(!Ring::Bits32.holds(30_000, units, 2768.0 * 65536.0));
    assert!(Ring::Bits64.holds(1 << 40, units, 1e12));
    assert_eq!(Ring::Bits32.signed(0xffff_ffff), -1);
    assert_eq!(Ring::Bits32.reduce(u64::MAX), 0xffff_ffff);
    assert!((noise_value_bound(1 << 32, 3) - 15.0 * (3.0f64 * 4294967296.0).sqrt()).abs() < 1e-6);
}
