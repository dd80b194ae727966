#![allow(
    clippy::unwrap_used,
    reason = "a panic is a benchmark's failure report"
)]
//! Masked rounds' costs (docs/secure-aggregation.md, "Costs"): the mask stream's speed, a
//! device's extra time and bytes per 1 MB update, and each key service's time per round of
//! 1,000 x 1 MB inputs (open its sealed seeds, expand and add its groups' streams), for the
//! layouts 2-of-3, 3-of-5 and 3-of-7, on one core and on every core (`MaskSums::add_many`). Prints figures; no criterion (each figure is
//! one long run, a load generator's).
//!
//! `cargo bench -p confed-protocol --bench masking` (`CONFED_BENCH_INPUTS=N` sets the inputs
//! each key service sums, default 1,000 for 2-of-3 and a tenth of that, projected, for the
//! larger layouts).

use std::time::Instant;

use confed_protocol::hpke::{PublicKey, generate_keypair};
use confed_protocol::masking::{
    Layout, MaskContext, MaskSums, Ring, Seed, StreamKeys, add_stream, mask, open_seeds, seal_seeds,
};

/// A 1 MB update of f32 values: 262,144 values on the grid, 2 MB masked in the ring of 2^64
/// (u64), 1 MB in the ring of 2^32 (u32).
const VALUES: usize = 1 << 18;
const POLICY: &str = "5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c";

fn context(assignment_ref: &str) -> MaskContext<'_> {
    MaskContext::new("bench-task", 1, assignment_ref, POLICY, VALUES).unwrap()
}

fn main() {
    let inputs: usize = std::env::var("CONFED_BENCH_INPUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    // The stream alone.
    let seed = Seed::random();
    let mut out = vec![0u64; VALUES];
    let reference = "0".repeat(64);
    let runs = 200;
    let started = Instant::now();
    for group in 0..runs {
        add_stream(&seed, &context(&reference), group, &mut out, Ring::Bits64).unwrap();
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "masking: one mask stream added to a 1 MB update's {VALUES} grid values: {:.2} ms ({:.2} GB/s of u64 masks)",
        1000.0 * seconds / runs as f64,
        (runs * VALUES * 8) as f64 / seconds / 1e9
    );
    // The device's clip on the grid: a fixed number of passes, whatever the values.
    let update: Vec<f32> = (0..VALUES)
        .map(|i| ((i % 200) as f32 - 100.0) * 1e-4)
        .collect();
    let clip_runs = 20;
    let started = Instant::now();
    for _ in 0..clip_runs {
        std::hint::black_box(confed_protocol::grid::clip_to_grid(&update, 1.0));
    }
    println!(
        "masking: the device's clip of a 1 MB update on the grid: {:.1} ms (fixed work)",
        1000.0 * started.elapsed().as_secs_f64() / clip_runs as f64
    );
    let grid: Vec<i64> = (0..VALUES as i64).map(|i| i % 200 - 100).collect();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (n, t, ring) in [
        (3u8, 2u8, Ring::Bits64),
        (3, 2, Ring::Bits32),
        (5, 3, Ring::Bits64),
        (5, 3, Ring::Bits32),
        (7, 3, Ring::Bits32),
    ] {
        let layout = Layout::new(n, t).unwrap().with_ring(ring);
        let keys: Vec<_> = (0..n).map(|_| generate_keypair()).collect();
        let public: Vec<PublicKey> = keys.iter().map(|(_, p)| *p).collect();
        let groups = layout.groups().len();
        // A device: draw the seeds, mask, seal each key service its seeds.
        let device_runs = 20;
        let started = Instant::now();
        let mut sealed_bytes = 0;
        for d in 0..device_runs {
            let reference = format!("{d:064x}");
            let ctx = context(&reference);
            let seeds: Vec<Seed> = (0..groups).map(|_| Seed::random()).collect();
            let masked = mask(&layout, &grid, &seeds, &ctx).unwrap();
            let sealed = seal_seeds(&layout, &seeds, &public, &ctx).unwrap();
            sealed_bytes = sealed
                .iter()
                .map(|s| s.encapsulated_key.len() + s.ciphertext.len() + 1)
                .sum::<usize>();
            assert_eq!(masked.len(), VALUES);
        }
        let device_ms = 1000.0 * started.elapsed().as_secs_f64() / device_runs as f64;
        // A key service: its groups' streams over the round's inputs.
        let service = 1u8;
        let mine = layout.groups_of(service).len();
        let summed = if groups == 3 {
            inputs
        } else {
            (inputs / 10).max(1)
        };
        let sealed: Vec<(String, Vec<_>)> = (0..summed)
            .map(|d| {
                let reference = format!("{d:064x}");
                let seeds: Vec<Seed> = (0..groups).map(|_| Seed::random()).collect();
                let sealed = seal_seeds(&layout, &seeds, &public, &context(&reference)).unwrap();
                (reference, sealed)
            })
            .collect();
        // As a key service does: open every input's seeds, then add every stream at once, on
        // one thread and then on each of the machine's cores.
        let key_service = |threads: usize| {
            let started = Instant::now();
            let streams: Vec<StreamKeys> = sealed
                .iter()
                .map(|(reference, sealed)| {
                    let ctx = context(reference);
                    let seeds = open_seeds(&layout, &keys[0].0, &sealed[0], &ctx).unwrap();
                    StreamKeys::of(&seeds, &ctx)
                })
                .collect();
            let mut sums = MaskSums::new(&layout, service, VALUES).unwrap();
            sums.add_many(&streams, layout.ring(), threads).unwrap();
            started.elapsed().as_secs_f64() / summed as f64
        };
        let per_input = key_service(1);
        let per_input_all_cores = key_service(cores);
        println!(
            "masking: {t}-of-{n} in 2^{} (q {}, {groups} groups of {}): device +{device_ms:.1} ms and +{} bytes per 1 MB update (+{} for the values' width, +{sealed_bytes} sealed seeds); a key service in {mine} groups: {:.2} s per round of 1,000 x 1 MB on one core, {:.2} s on {cores}{}",
            ring.bits(),
            layout.quorum(),
            layout.groups()[0].len(),
            VALUES * (ring.bytes() - 4) + sealed_bytes,
            VALUES * (ring.bytes() - 4),
            per_input * 1000.0,
            per_input_all_cores * 1000.0,
            if summed == 1000 {
                String::new()
            } else {
                format!(" (projected from {summed} inputs)")
            }
        );
    }
}
