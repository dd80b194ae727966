#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! What making every update well formed costs a device (`UpdateShape::well_formed`: parse the
//! trained update, check names, shapes and finiteness, re-encode), beside sealing it, for the
//! device cycle's 16 KB update and a 1 MB one. Run with
//! `cargo bench -p confed-device --bench well_formed`; prints microseconds per update.

use std::time::Instant;

use confed_device::UpdateShape;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

fn model(values: usize) -> Vec<u8> {
    let weights: Vec<u8> = (0..values - 4)
        .flat_map(|i| (i as f32 * 1e-4).to_le_bytes())
        .collect();
    let bias = vec![0u8; 16];
    safetensors::serialize(
        [
            (
                "dense.weight",
                TensorView::new(Dtype::F32, vec![4, (values - 4) / 4], &weights).unwrap(),
            ),
            (
                "dense.bias",
                TensorView::new(Dtype::F32, vec![4], &bias).unwrap(),
            ),
        ],
        None,
    )
    .unwrap()
}

fn main() {
    for (label, values) in [("16 KB", 4096usize), ("1 MB", 262_144)] {
        let bytes = model(values);
        let shape = UpdateShape::of_model(&bytes).unwrap();
        let (public_key, _) = {
            let (private, public) = confed_protocol::hpke::generate_keypair();
            (public, private)
        };
        let iterations = if values > 10_000 { 300 } else { 20_000 };
        // The clone hands `well_formed` the bytes training would: timed apart and taken off.
        let started = Instant::now();
        let mut total = 0usize;
        for _ in 0..iterations {
            total += std::hint::black_box(bytes.clone()).len();
        }
        let cloning = started.elapsed().as_secs_f64() * 1e6 / iterations as f64;
        let started = Instant::now();
        for _ in 0..iterations {
            let update = shape.well_formed(Ok(bytes.clone()), None);
            total += update.bytes().len();
        }
        let formed = started.elapsed().as_secs_f64() * 1e6 / iterations as f64 - cloning;
        let update = shape.well_formed(Ok(bytes.clone()), None);
        let context = confed_protocol::envelope::RoundContext {
            task_id: "t".into(),
            round: 1,
            policy_sha256: "0".repeat(64),
            model_sha256: "0".repeat(64),
        };
        let started = Instant::now();
        for _ in 0..iterations {
            let sealed = confed_protocol::envelope::seal_with(
                &confed_protocol::hpke::RustCrypto,
                &public_key,
                "k1",
                &context,
                &confed_protocol::ids::Capability::new("a1"),
                update.bytes(),
            )
            .unwrap();
            total += sealed.ciphertext.len();
        }
        let sealed = started.elapsed().as_secs_f64() * 1e6 / iterations as f64;
        println!(
            "{label} update: well_formed {formed:.1} us, seal {sealed:.1} us (well_formed is {:.0} % of sealing) [{total}]",
            formed / sealed * 100.0
        );
    }
}
