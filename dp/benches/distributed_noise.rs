#![allow(
    clippy::unwrap_used,
    reason = "a panic is a benchmark's failure report"
)]
//! Distributed noise's cost at a key service (docs/secure-aggregation.md, "Costs"): drawing one
//! group's discrete Gaussian for a 1 MB update (262,144 values) and subtracting it from the
//! group's mask sums, at the noise a budget calibrates for a few plans, on one core; and what
//! that is per service for the layouts 2-of-3, 3-of-5 and 3-of-7 (1, 4 and 15 groups each).
//! Prints figures; no criterion (each figure is one long run).
//!
//! `cargo bench -p confed-dp --features noise --bench distributed_noise`

use std::time::Instant;

use confed_dp::{ClosedForm, calibrate_task, distributed};
use confed_protocol::mechanism::{DpMechanism, Mechanism};

const VALUES: usize = 1 << 18;

fn main() {
    println!(
        "distributed noise, one group's draw subtracted from 1 MB of mask sums (262,144 values), one core"
    );
    for (epsilon, rounds) in [(8.0, 10), (8.0, 100), (1.0, 100)] {
        let z = calibrate_task(
            &ClosedForm,
            DpMechanism::plain(Mechanism::Gaussian),
            epsilon,
            1e-6,
            rounds,
        )
        .unwrap()
        .noise_multiplier;
        let scale = z * 65536.0;
        let variance = (scale * scale).ceil() as u64;
        let mut sum = vec![0u64; VALUES];
        let runs = 10;
        let started = Instant::now();
        for run in 0..runs {
            distributed::noise_mask_sum(&mut sum, variance, &[run as u8; 32]);
        }
        let per_group = started.elapsed().as_secs_f64() / f64::from(runs);
        println!(
            "  epsilon {epsilon} over {rounds} rounds (z {z:.3}, sigma {scale:.0} grid units): {:.1} ms per group ({:.1} M values/s); per service: 2-of-3 {:.0} ms, 3-of-5 {:.0} ms, 3-of-7 {:.0} ms",
            per_group * 1e3,
            VALUES as f64 / per_group / 1e6,
            per_group * 1e3,
            4.0 * per_group * 1e3,
            15.0 * per_group * 1e3,
        );
        std::hint::black_box(&sum);
    }
}
