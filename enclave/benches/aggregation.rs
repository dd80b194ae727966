#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! Aggregation throughput (criterion): 1 KB and 1 MB contributions on 1 and 2 threads, against
//! the bound (ring's AES-128-GCM opening the same number of bytes plus the f32 -> f64 sum, no key
//! encapsulation, no validation, no clipping), and the noise sampler. After criterion's figures a
//! summary prints contributions/s, GB/s of ciphertext, the ratio to the bound, the 1 -> 2 thread
//! speed-up, the inputs digest (BLAKE3) the worker computes on its first read, noise
//! coordinates/s, and peak memory while streaming many 1 MB contributions. The summary also
//! prints a second bound with the HPKE open the enclave does on this CPU (`bound_this_cpu`):
//! where AWS-LC's AES-GCM is the faster one, ring's bound is slower than the enclave's own open.
//!
//! `cargo bench -p confed-enclave --bench aggregation` (`CONFED_BENCH_SUMMARY_ONLY=1` for the
//! summary without criterion's figures; `CONFED_BENCH_PROFILE_1MB=1` aggregates 1 MB contributions
//! on one thread for a minute, to run under `perf record`). The enclave opens with AWS-LC's or ring's AES-GCM,
//! whichever is faster on the CPU (`Backend::for_this_cpu`); the summary names which.

use std::hint::black_box;
use std::time::{Duration, Instant};

use confed_enclave::aggregate::{Aggregator, Binding, PrivacyParams, noise};
use confed_enclave::dp::{DiscreteGaussian, grid};
use confed_enclave::envelope;
use confed_enclave::hpke::{PrivateKey, PublicKey, generate_keypair};
use confed_enclave::hpke_awslc::Recipient;
use confed_enclave::policy::{EVALUATION_TENSOR, EXAMPLES_TENSOR, Evaluation, Weighting};
use confed_worker_api::model::{ModelSchema, encode_f32_tensors, validate_model};
use criterion::{Criterion, Throughput};
use ring::aead::{AES_128_GCM, Aad, LessSafeKey, Nonce, UnboundKey};

const TASK: &str = "bench-task";
const KEY: &str = "bench-key";

struct Fixture {
    private: PrivateKey,
    schema: ModelSchema,
    contributions: Vec<(String, Option<Vec<u8>>)>,
    /// Raw AES-GCM ciphertexts of the same plaintexts, for the bound.
    raw: Vec<Vec<u8>>,
    /// The same plaintexts HPKE-sealed in one piece (encapsulated key, ciphertext), for the
    /// bound with the AEAD this CPU opens with.
    hpke: Vec<(Vec<u8>, Vec<u8>)>,
    ciphertext_bytes: usize,
    /// An evaluation round's: every update carries a metrics tensor, the aggregator sums them.
    evaluation: Option<Evaluation>,
    /// The update size from which the aggregator streams (`None`: the default,
    /// `aggregate::STREAM_ABOVE_BYTES`; `Some(0)` streams every update).
    stream_above: Option<usize>,
    /// Example weighting: every update carries its count, the aggregator weighs by it.
    weighting: Option<Weighting>,
}

/// Example weighting at a cap of 100: the fixtures' counts run 1..=200, so about half weigh 1.
const WEIGHTING: Weighting = Weighting { max_examples: 100 };

/// Evaluation every round, 100 examples a device at most, noise of 1,000 examples.
const EVALUATION: Evaluation = Evaluation {
    every: 1,
    max_loss: 10.0,
    max_examples: 100,
    stddev: 1000.0,
    on_demand: 0,
};

fn values(params: usize, seed: u32) -> Vec<f32> {
    (0..params)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
        .map(|v| v * 1e-3)
        .collect()
}

fn update(params: usize, seed: u32) -> Vec<u8> {
    encode_f32_tensors(&[("w", vec![params], &values(params, seed))]).unwrap()
}

/// An update of `values`, with the metrics tensor when `evaluation` and the example count when
/// `examples` is given.
fn encoded(values: &[f32], evaluation: bool, examples: Option<f32>) -> Vec<u8> {
    let metrics = [20.0f32, 7.0, 10.0];
    let count = [examples.unwrap_or(0.0)];
    let mut tensors = vec![("w", vec![values.len()], values)];
    if evaluation {
        tensors.push((EVALUATION_TENSOR, vec![3], &metrics[..]));
    }
    if examples.is_some() {
        tensors.push((EXAMPLES_TENSOR, vec![1], &count[..]));
    }
    encode_f32_tensors(&tensors).unwrap()
}

fn seal(public: &PublicKey, index: usize, plaintext: &[u8]) -> (String, Vec<u8>) {
    let id = format!("assignment-{index}");
    // Sealed as the load generator seals (AWS-LC), so the setup is what it was before sealing
    // moved to the protocol crate (its allocations shape the memory figures below).
    let sealed = envelope::seal_with(
        &confed_enclave::hpke_awslc::AwsLc,
        public,
        KEY,
        &context(),
        &id.as_str().into(),
        plaintext,
    )
    .unwrap();
    (envelope::assignment_ref(&id), sealed.to_cbor())
}

fn raw_key() -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&AES_128_GCM, &[7u8; 16]).unwrap())
}

fn fixture(params: usize, count: usize) -> Fixture {
    fixture_scaled(params, count, |_| 1.0)
}

/// `fixture` with contribution `i`'s values multiplied by `scale(i)`: at 20 a 1 MB update's L2
/// norm is about 3, above the clip norm of 1, so the aggregator clips it.
fn fixture_scaled(params: usize, count: usize, scale: impl Fn(usize) -> f32) -> Fixture {
    fixture_with(params, count, scale, None, None)
}

/// `fixture` for an evaluation round: every update carries the device's metrics.
fn fixture_evaluated(params: usize, count: usize) -> Fixture {
    fixture_with(params, count, |_| 1.0, Some(EVALUATION), None)
}

/// `fixture` for example-weighted averaging: every update carries its count.
fn fixture_weighted(params: usize, count: usize) -> Fixture {
    fixture_with(params, count, |_| 1.0, None, Some(WEIGHTING))
}

fn fixture_with(
    params: usize,
    count: usize,
    scale: impl Fn(usize) -> f32,
    evaluation: Option<Evaluation>,
    weighting: Option<Weighting>,
) -> Fixture {
    let (private, public) = generate_keypair();
    let schema = validate_model(&update(params, 0)).unwrap();
    let key = raw_key();
    let mut contributions = Vec::with_capacity(count);
    let mut raw = Vec::with_capacity(count);
    let mut hpke = Vec::with_capacity(count);
    let mut ciphertext_bytes = 0;
    for i in 0..count {
        let factor = scale(i);
        let scaled: Vec<f32> = values(params, i as u32)
            .into_iter()
            .map(|v| v * factor)
            .collect();
        let examples = weighting.map(|_| (i % 200 + 1) as f32);
        let plaintext = encoded(&scaled, evaluation.is_some(), examples);
        let (id, bytes) = seal(&public, i, &plaintext);
        ciphertext_bytes += bytes.len();
        contributions.push((id, Some(bytes)));
        let (enc, sealed) =
            confed_enclave::hpke_awslc::seal(&public, b"info", b"aad", &plaintext).unwrap();
        hpke.push((enc.to_vec(), sealed));
        let mut sealed = plaintext;
        key.seal_in_place_append_tag(
            Nonce::assume_unique_for_key([0; 12]),
            Aad::empty(),
            &mut sealed,
        )
        .unwrap();
        raw.push(sealed);
    }
    Fixture {
        private,
        schema,
        contributions,
        raw,
        hpke,
        ciphertext_bytes,
        evaluation,
        weighting,
        stream_above: None,
    }
}

/// `f` aggregated from updates held whole (`usize::MAX`) or streamed chunk by chunk (0).
fn streaming_from(mut f: Fixture, bytes: usize) -> Fixture {
    f.stream_above = Some(bytes);
    f
}

fn context() -> envelope::RoundContext {
    envelope::RoundContext {
        task_id: TASK.into(),
        round: 1,
        policy_sha256: "0".repeat(64),
        model_sha256: "1".repeat(64),
    }
}

fn binding() -> Binding {
    Binding {
        context: context(),
        key_id: KEY.into(),
        inputs_digest: "2".repeat(64),
    }
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

/// Opens, checks, clips and sums every contribution (no noise: that is measured apart).
fn aggregate(f: &Fixture, pool: &rayon::ThreadPool) {
    let mut agg = Aggregator::new(binding(), 1.0, f.schema.clone(), &f.private)
        .unwrap()
        .evaluating(f.evaluation)
        .weighing(f.weighting);
    if let Some(bytes) = f.stream_above {
        agg = agg.stream_above(bytes);
    }
    pool.install(|| agg.add_batch(&f.contributions));
    assert_eq!(agg.counts(), (f.contributions.len(), 0));
    black_box(agg);
}

/// The bound: raw AES-128-GCM open of the same plaintexts plus the f32 -> f64 sum, one thread.
fn bound(f: &Fixture, sum: &mut [f64]) {
    let key = raw_key();
    let mut buffer = Vec::new();
    for sealed in &f.raw {
        buffer.clear();
        buffer.extend_from_slice(sealed);
        let plain = key
            .open_in_place(
                Nonce::assume_unique_for_key([0; 12]),
                Aad::empty(),
                &mut buffer,
            )
            .unwrap();
        // Skip the safetensors header: sum the tensor bytes.
        let data = &plain[plain.len() - sum.len() * 4..];
        for (s, v) in sum.iter_mut().zip(data.chunks_exact(4)) {
            *s += f64::from(f32::from_le_bytes([v[0], v[1], v[2], v[3]]));
        }
    }
    black_box(sum);
}

/// The bound with this CPU's AEAD: the HPKE open the enclave does (`Backend::for_this_cpu`: the
/// key encapsulation included) of the same plaintexts plus the same sum, one thread. Where
/// AWS-LC's AES-GCM is the faster (VAES on AVX-512), ring's bound above is slower than the
/// enclave's own open, and a ratio to it says nothing of what is left.
fn bound_this_cpu(f: &Fixture, recipient: &Recipient, sum: &mut [f64]) {
    let mut plain = Vec::new();
    for (enc, sealed) in &f.hpke {
        recipient
            .open_into(enc, b"info", b"aad", sealed, None, &mut plain)
            .unwrap();
        let data = &plain[plain.len() - sum.len() * 4..];
        for (s, v) in sum.iter_mut().zip(data.chunks_exact(4)) {
            *s += f64::from(f32::from_le_bytes([v[0], v[1], v[2], v[3]]));
        }
    }
    black_box(sum);
}

fn time(mut run: impl FnMut(), repeats: usize) -> Duration {
    run(); // warm-up
    let mut best = Duration::MAX;
    for _ in 0..repeats {
        let started = Instant::now();
        run();
        best = best.min(started.elapsed());
    }
    best
}

fn bench_size(c: &mut Criterion, label: &str, f: &Fixture, params: usize) {
    let mut group = c.benchmark_group(format!("aggregate_{label}"));
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(4));
    group.throughput(Throughput::Bytes(f.ciphertext_bytes as u64));
    for threads in [1, 2] {
        let p = pool(threads);
        group.bench_function(format!("{threads}_threads"), |b| {
            b.iter(|| aggregate(f, &p))
        });
    }
    let mut sum = vec![0f64; params];
    group.bench_function("bound_aes128gcm_plus_sum_1_thread", |b| {
        b.iter(|| bound(f, &mut sum))
    });
    group.finish();
}

fn noise_scale() -> DiscreteGaussian {
    // epsilon 1, delta 1e-6, 10 rounds: about 14 clip norms per round.
    DiscreteGaussian::at_least(14.3 * grid::GRID_UNITS_PER_CLIP as f64).unwrap()
}

fn bench_noise(c: &mut Criterion) {
    let mut group = c.benchmark_group("noise");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(4));
    let n = 1 << 20;
    group.throughput(Throughput::Elements(n as u64));
    let g = noise_scale();
    for threads in [1, 2] {
        let p = pool(threads);
        // A Gaussian round's release noise (`sampler_steps`), then the scalar draws' sampler.
        group.bench_function(format!("discrete_gaussian_steps_{threads}_threads"), |b| {
            b.iter(|| p.install(|| black_box(noise::samples_steps(n, &g, &[3; 32]))))
        });
        // The name it has had since before the step sampler, so saved baselines still compare.
        group.bench_function(format!("discrete_gaussian_{threads}_threads"), |b| {
            b.iter(|| p.install(|| black_box(noise::samples(n, &g, &[3; 32]))))
        });
    }
    group.finish();
    bench_tree_noise(c, &g);
    // BLT draws on its lattice (2^lattice_bits units per grid unit; 9 bits at this noise, as
    // `lattice_bits_for` picks): a standard deviation near 2^29, where the sampler's acceptance
    // tests take their long path.
    let lattice =
        DiscreteGaussian::at_least(14.3 * (grid::GRID_UNITS_PER_CLIP << 9) as f64).unwrap();
    bench_blt_noise(c, &lattice);
}

/// BLT noise for one round of a 2^20-value model on one thread: the whole step (the sampler,
/// the exact fixed-point strategy buffers, the inverse's f64 buffers) with 1, 3 and 7 buffers.
/// Throughput is noised values (coordinates) per second.
fn bench_blt_noise(c: &mut Criterion, g: &DiscreteGaussian) {
    use confed_enclave::dp::blt::BltKernel;
    use confed_protocol::blt_noise::quantize;
    let mut group = c.benchmark_group("blt_noise");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(6));
    let n = 1 << 20;
    group.throughput(Throughput::Elements(n as u64));
    let one = pool(1);
    // The sampler alone (what BLT noise draws from), for the split of the step's time.
    group.bench_function("sampler_alone_1_thread", |b| {
        use rand_core::SeedableRng;
        let steps = g.steps();
        b.iter(|| {
            let mut rng = rand_chacha::ChaCha12Rng::from_seed([7; 32]);
            let mut bits = confed_enclave::dp::sampler_bits::Bits::new(&mut rng);
            let mut total = 0i64;
            for _ in 0..n {
                total = total.wrapping_add(steps.sample(&mut bits));
            }
            black_box(total)
        })
    });
    for buffers in [1usize, 3, 7] {
        let (blt, _) = confed_dp::blt_optimize::optimize_buffers(
            &confed_dp::blt::Setting::new(2000, 100, confed_dp::blt::ErrorKind::Max),
            buffers.min(3),
        );
        // Up to 3 buffers as optimized; 7 as the rational approximation's start (a valid BLT).
        let blt = if buffers > 3 {
            confed_dp::blt::initial(buffers)
        } else {
            blt
        };
        let decays: Vec<f64> = blt.decays.iter().map(|t| quantize(*t)).collect();
        let scales: Vec<f64> = blt.scales.iter().map(|w| quantize(*w)).collect();
        let inverse = confed_dp::blt::Blt::new(decays.clone(), scales.clone()).inverse();
        let kernel =
            BltKernel::new(&decays, &scales, (&inverse.decays, &inverse.scales), 9).unwrap();
        let sum: Vec<i64> = (0..n as i64).map(|i| i % 1000 - 500).collect();
        let mut state = kernel.initial_state(n);
        group.bench_function(format!("{buffers}_buffers_1_thread"), |b| {
            b.iter(|| {
                one.install(|| black_box(kernel.step(&mut state, &sum, g, &[5; 32]).unwrap()))
            })
        });
        if buffers == 3 {
            bench_blt_state(&mut group, &kernel, &state, n);
        }
    }
    group.finish();
}

/// Sealing the state a round leaves for the next (AES-256-GCM and the synthetic nonce's keyed
/// BLAKE3 over 16 bytes a strategy buffer and 8 an inverse buffer, per value), and opening it.
fn bench_blt_state(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    kernel: &confed_enclave::dp::blt::BltKernel,
    state: &confed_enclave::dp::blt::BltState,
    n: usize,
) {
    use confed_enclave::aggregate::blt_state::{Continuing, StateHeader, open, seal};
    let (private, _) = confed_enclave::hpke::generate_keypair();
    let header = StateHeader {
        task_id: "bench".into(),
        policy_sha256: "ab".repeat(32),
        round: 1,
        inputs_digest: "cd".repeat(32),
        values: n as u64,
        buffers: kernel.buffers() as u32,
        inverse_buffers: (state.release.len() / n) as u32,
    };
    let sealed = seal(&private, &header, state).unwrap();
    let next = Continuing {
        task_id: "bench",
        policy_sha256: &header.policy_sha256,
        round: 2,
        values: n as u64,
        buffers: header.buffers,
        inverse_buffers: header.inverse_buffers,
    };
    group.bench_function("3_buffers_seal_state", |b| {
        b.iter(|| black_box(seal(&private, &header, state).unwrap()))
    });
    group.bench_function("3_buffers_open_state", |b| {
        b.iter(|| black_box(open(&private, &sealed, &next).unwrap()))
    });
}

/// DP-FTRL's noise for one release of a 2^20-value model, on both cores, at tree positions whose
/// increments combine 1 (odd positions), 15 (position 8) and 127 (position 64) node vectors: the
/// whole noising step, exact integer weights included.
fn bench_tree_noise(c: &mut Criterion, g: &DiscreteGaussian) {
    use confed_enclave::dp::tree::Trees;
    let mut group = c.benchmark_group("tree_noise");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(6));
    let n = 1 << 20;
    let trees = Trees { length: 1024 };
    for position in [1u64, 8, 64] {
        let nodes: Vec<_> = trees
            .release(position)
            .into_iter()
            .enumerate()
            .map(|(i, (_, weight))| (weight, zeroize::Zeroizing::new([i as u8; 32])))
            .collect();
        group.throughput(Throughput::Elements((n * nodes.len()) as u64));
        group.bench_function(format!("position_{position}_{}_nodes", nodes.len()), |b| {
            let sum = vec![0i64; n];
            let d = trees.denominator();
            b.iter(|| {
                black_box(noise::tree_values(&sum, d, g, &nodes, |x| {
                    (x / i128::from(d)) as f32
                }))
            })
        });
    }
    group.finish();
}

fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

fn reset_peak_rss() {
    // Linux: writing 5 to clear_refs resets VmHWM to the current RSS.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Aggregates `count` pre-sealed contributions of a model with `params` values, two at a time,
/// and returns the growth of peak RSS during aggregation alone (the sealed inputs exist before
/// the measurement starts). Models of 8 MiB and more are streamed chunk by chunk here (by
/// default only models of 64 MiB and more are: `aggregate::STREAM_ABOVE_BYTES`).
fn aggregation_peak(count: usize, params: usize, evaluating: bool) -> u64 {
    let (private, public) = generate_keypair();
    let schema = validate_model(&update(params, 0)).unwrap();
    let plaintext = encoded(&values(params, 1), evaluating, None);
    let inputs: Vec<(String, Option<Vec<u8>>)> = (0..count)
        .map(|i| {
            let (id, bytes) = seal(&public, i, &plaintext);
            (id, Some(bytes))
        })
        .collect();
    drop(plaintext);
    reset_peak_rss();
    let start = peak_rss_bytes();
    let evaluation = evaluating.then_some(EVALUATION);
    let agg = Aggregator::new(binding(), 1.0, schema, &private)
        .unwrap()
        .evaluating(evaluation)
        .stream_above(8 << 20);
    for pair in inputs.chunks(2) {
        agg.add_batch(pair);
    }
    let release = agg
        .finish(
            &private,
            PrivacyParams {
                epsilon: 4.0,
                delta: 1e-6,
                clip_norm: 1.0,
                rounds: 1,
                min_reports: 1,
                mechanism: confed_enclave::policy::Mechanism::Gaussian,
                adaptive: None,
                evaluation,
                on_demand: false,
                health: None,
                weighting: None,
            },
        )
        .unwrap();
    black_box(release);
    peak_rss_bytes().saturating_sub(start)
}

/// HPKE opening of 1 MB with each backend the enclave has, and which one this CPU gets.
fn aead_summary() {
    use confed_enclave::hpke_awslc::{Backend, seal};
    let (private, public) = generate_keypair();
    let plaintext = vec![3u8; 1 << 20];
    let (enc, ciphertext) = seal(&public, b"info", b"aad", &plaintext).unwrap();
    let mut out = Vec::new();
    let rates: Vec<String> = [Backend::AwsLc, Backend::Ring]
        .into_iter()
        .map(|backend| {
            let recipient = Recipient::with_backend(&private, backend).unwrap();
            let seconds = time(
                || {
                    for _ in 0..200 {
                        recipient
                            .open_into(&enc, b"info", b"aad", &ciphertext, None, &mut out)
                            .unwrap();
                    }
                },
                5,
            );
            let gbps = 200.0 * ciphertext.len() as f64 / seconds.as_secs_f64() / 1e9;
            format!("{backend:?} {gbps:.2} GB/s")
        })
        .collect();
    println!(
        "HPKE open of 1 MB, 1 thread: {}; this CPU opens with {:?}",
        rates.join(", "),
        Backend::for_this_cpu()
    );
}

fn summary(small: &Fixture, large: &Fixture, large_params: usize) {
    println!("\n== aggregation summary (best of 5) ==");
    aead_summary();
    let huge_params = 4 << 20;
    // Streamed, as models of 64 MiB and more are: every update is decrypted twice, measured and
    // then added. Held whole, as 16 MB models are.
    let huge = streaming_from(fixture(huge_params, 6), 0);
    let huge_buffered = streaming_from(fixture(huge_params, 6), usize::MAX);
    // Real updates are often clipped (clip norms sit near the median norm): half of them, and all.
    let count = large.contributions.len();
    // Built alike, so the three 1 MB rows differ only in how many updates are clipped.
    let none_clipped = fixture_scaled(large_params, count, |_| 1.0);
    let half_clipped = fixture_scaled(large_params, count, |i| if i % 2 == 0 { 20.0 } else { 1.0 });
    let all_clipped = fixture_scaled(large_params, count, |_| 20.0);
    let evaluated = fixture_evaluated(large_params, count);
    let huge_evaluated = streaming_from(fixture_evaluated(huge_params, 6), 0);
    let weighted = fixture_weighted(large_params, count);
    let huge_weighted = streaming_from(fixture_weighted(huge_params, 6), 0);
    for (label, f, params) in [
        ("1 KB", small, 256),
        ("1 MB", &none_clipped, large_params),
        ("1 MB, half clipped", &half_clipped, large_params),
        ("1 MB, all clipped", &all_clipped, large_params),
        ("1 MB, evaluation round", &evaluated, large_params),
        ("16 MB (streamed)", &huge, huge_params),
        ("16 MB (held whole)", &huge_buffered, huge_params),
        (
            "16 MB (streamed), evaluation round",
            &huge_evaluated,
            huge_params,
        ),
        ("1 MB, weighted by examples", &weighted, large_params),
        (
            "16 MB (streamed), weighted by examples",
            &huge_weighted,
            huge_params,
        ),
    ] {
        let n = f.contributions.len() as f64;
        let gb = f.ciphertext_bytes as f64 / 1e9;
        let one = time(|| aggregate(f, &pool(1)), 5).as_secs_f64();
        let two = time(|| aggregate(f, &pool(2)), 5).as_secs_f64();
        let mut sum = vec![0f64; params];
        let bound_s = time(|| bound(f, &mut sum), 5).as_secs_f64();
        let recipient = Recipient::new(&f.private).unwrap();
        let this_cpu_s = time(|| bound_this_cpu(f, &recipient, &mut sum), 5).as_secs_f64();
        println!(
            "{label}: 1 thread {:>9.0} contributions/s {:>5.2} GB/s | 2 threads {:>9.0}/s {:>5.2} GB/s (x{:.2}) | bound {:>5.2} GB/s, ratio per core {:.2} | bound with this CPU's HPKE open {:>5.2} GB/s, ratio per core {:.2}",
            n / one,
            gb / one,
            n / two,
            gb / two,
            one / two,
            gb / bound_s,
            bound_s / one,
            gb / this_cpu_s,
            this_cpu_s / one
        );
    }
    // The worker's first read digests every input (BLAKE3) before it asks for the key.
    let stored: Vec<Option<Vec<u8>>> = large.contributions.iter().map(|(_, b)| b.clone()).collect();
    for threads in [1, 2] {
        let p = pool(threads);
        let s = time(
            || {
                p.install(|| {
                    black_box(confed_enclave::aggregate::inputs::digest_all(&stored));
                })
            },
            5,
        )
        .as_secs_f64();
        println!(
            "inputs digest (BLAKE3 of 1 MB contributions): {threads} thread(s) {:.2} GB/s",
            large.ciphertext_bytes as f64 / 1e9 / s
        );
    }
    let g = noise_scale();
    let n = 1 << 22;
    type Draw = fn(usize, &DiscreteGaussian, &[u8; 32]) -> Vec<i64>;
    let samplers: [(&str, Draw); 2] = [
        (
            "a Gaussian round's release (sampler_steps)",
            noise::samples_steps,
        ),
        ("trees, counts and analytics (sampler)", noise::samples),
    ];
    for (what, draw) in samplers {
        for threads in [1, 2] {
            let p = pool(threads);
            let s = time(
                || {
                    p.install(|| {
                        black_box(draw(n, &g, &[5; 32]));
                    })
                },
                3,
            )
            .as_secs_f64();
            println!(
                "noise, {what}: {threads} thread(s) {:.1} million coordinates/s",
                n as f64 / s / 1e6
            );
        }
    }
    for (params, counts, evaluating) in [
        (large_params, [8usize, 32], false),
        (4 << 20, [4, 8], false),
        (4 << 20, [4, 8], true),
    ] {
        let model_bytes = (params * 4) as f64 / 1e6;
        for count in counts {
            // In a fresh process: this one's allocator already holds memory from the runs above.
            let output = std::process::Command::new(std::env::current_exe().unwrap())
                .env(
                    "CONFED_BENCH_MEMORY",
                    format!("{count}:{params}:{evaluating}"),
                )
                .output()
                .unwrap();
            let peak = String::from_utf8_lossy(&output.stdout)
                .trim()
                .parse::<f64>()
                .unwrap_or(f64::NAN)
                / 1e6;
            println!(
                "memory: {count} contributions of a {model_bytes:.0} MB model on 2 threads{}: aggregation peak RSS +{peak:.1} MB ({:.2}x the model)",
                if evaluating { ", evaluation round" } else { "" },
                peak / model_bytes
            );
        }
    }
}

fn main() {
    if let Ok(spec) = std::env::var("CONFED_BENCH_MEMORY") {
        let mut parts = spec.split(':');
        let (count, params, evaluating) = (
            parts.next().expect("count"),
            parts.next().expect("params"),
            parts.next() == Some("true"),
        );
        let pool = pool(2);
        let peak = pool.install(|| {
            aggregation_peak(
                count.parse().expect("count"),
                params.parse().expect("params"),
                evaluating,
            )
        });
        println!("{peak}");
        return;
    }
    let small = fixture(256, 4000);
    let large_params = (1 << 20) / 4;
    let large = fixture(large_params, 48);
    // One thread aggregating the 1 MB fixture for a minute, nothing else: what to run under
    // `perf record` to see where a core's time goes (docs/performance.md, "Per core").
    if std::env::var_os("CONFED_BENCH_PROFILE_1MB").is_some() {
        let pool = pool(1);
        let started = Instant::now();
        let mut rounds = 0;
        while started.elapsed() < Duration::from_secs(60) {
            aggregate(&large, &pool);
            rounds += 1;
        }
        let gb = rounds as f64 * large.ciphertext_bytes as f64 / 1e9;
        println!("{:.2} GB/s", gb / started.elapsed().as_secs_f64());
        return;
    }
    // The summary alone (the ratios the issues ask for) in a minute instead of ten.
    if std::env::var_os("CONFED_BENCH_SUMMARY_ONLY").is_some() {
        summary(&small, &large, large_params);
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    bench_size(&mut c, "1KB", &small, 256);
    bench_size(&mut c, "1MB", &large, large_params);
    bench_noise(&mut c);
    c.final_summary();
    // A criterion filter (e.g. `-- noise`) measures just that; the summary needs everything.
    let filtered = std::env::args().skip(1).any(|a| !a.starts_with('-'));
    if !filtered {
        summary(&small, &large, large_params);
    }
}
