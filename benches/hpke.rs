#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! HPKE open throughput, one core: the RustCrypto `hpke` crate versus AWS-LC's HPKE (what the
//! enclave uses), for 1 KB and 1 MB updates, each followed by the f32 -> f64 sum the aggregator
//! does. Run with `cargo bench --bench hpke`.

use std::time::Instant;

use confed_enclave::hpke_awslc::Recipient;
use confed_protocol::hpke::{self, generate_keypair};

fn sum(plaintext: &[u8], acc: &mut [f64]) {
    for (slot, c) in acc.iter_mut().zip(plaintext.chunks_exact(4)) {
        *slot += f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
    }
}

fn main() {
    let (private, public) = generate_keypair();
    let recipient = Recipient::new(&private).unwrap();
    for (label, size, count) in [("1 KB", 1024usize, 20_000usize), ("1 MB", 1 << 20, 300)] {
        let plaintext: Vec<u8> = (0..size).map(|i| (i % 200) as u8).collect();
        let sealed: Vec<_> = (0..count.min(64))
            .map(|_| hpke::seal(&public, b"info", b"aad", &plaintext).unwrap())
            .collect();
        let mut acc = vec![0f64; size / 4];
        let started = Instant::now();
        for i in 0..count {
            let (enc, ct) = &sealed[i % sealed.len()];
            sum(
                &hpke::open(&private, enc, b"info", b"aad", ct).unwrap(),
                &mut acc,
            );
        }
        let rust = started.elapsed();
        let started = Instant::now();
        for i in 0..count {
            let (enc, ct) = &sealed[i % sealed.len()];
            sum(&recipient.open(enc, b"info", b"aad", ct).unwrap(), &mut acc);
        }
        let awslc = started.elapsed();
        let report = |name: &str, elapsed: std::time::Duration| {
            let per_second = count as f64 / elapsed.as_secs_f64();
            println!(
                "{label} updates, {name:<22} {per_second:>10.0} opens/s  {:>6.2} GB/s",
                per_second * size as f64 / 1e9
            );
        };
        report("hpke crate (RustCrypto)", rust);
        report("AWS-LC EVP_HPKE", awslc);
    }
}
