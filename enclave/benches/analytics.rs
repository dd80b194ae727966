#![allow(
    clippy::unwrap_used,
    reason = "a panic is a benchmark's failure report"
)]
//! Analytics aggregation throughput and memory (docs/performance.md, "Analytics"): reports of 16
//! keys drawn from an open domain of 1,000,000 words, as the enclave opens them (HPKE, the
//! answer's checks, the sharded table), on 1 and 2 threads; the table alone (answers already
//! opened); the release (noise on every key, the threshold, the result's JSON); and the peak
//! memory of a round of 10,000,000 reports streamed through the table, against 1,000,000, to show
//! it is bounded by the domain, not the reports; and a round in 2 partitions (each sealed, the
//! root's merge of both) against one worker. Prints figures; no criterion (each figure is one
//! long run, a load generator's).
//!
//! `cargo bench -p confed-enclave --bench analytics` (`CONFED_BENCH_REPORTS=N` sets the sealed
//! reports, default 100,000; `CONFED_BENCH_STREAMED=N` the streamed ones, default 10,000,000).

use std::time::Instant;

use confed_enclave::aggregate::Binding;
use confed_enclave::aggregate::inputs::Input;
use confed_enclave::aggregate::partition::{Partial, Partition};
use confed_enclave::analytics::{AnalyticsAggregator, AnalyticsParams};
use confed_enclave::envelope;
use confed_enclave::hpke::{PublicKey, generate_keypair};
use confed_protocol::analytics::AnalyticsQuery;
use confed_protocol::answer::{self, Key};
use confed_protocol::policy::TaskPolicy;
use rayon::prelude::*;

const KEY: &str = "bench-key";
const DOMAIN: u64 = 1_000_000;
const KEYS: u32 = 16;

fn query() -> AnalyticsQuery {
    AnalyticsQuery::OpenHistogram {
        max_key_bytes: 16,
        keys_per_device: KEYS,
    }
}

fn context() -> envelope::RoundContext {
    envelope::RoundContext {
        task_id: "bench-task".into(),
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

/// SplitMix64 for the reports' words (benchmark data, not noise).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Report `r`'s answer: 16 distinct words of the domain, uniformly drawn.
fn answer_of(r: u64) -> Vec<u8> {
    let mut words = std::collections::BTreeSet::new();
    let mut i = 0;
    while words.len() < KEYS as usize {
        words.insert(format!("w{:07}", mix(r.wrapping_mul(64) + i) % DOMAIN));
        i += 1;
    }
    let slots: Vec<(Key<'_>, u64)> = words.iter().map(|w| (Key::Text(w.as_bytes()), 1)).collect();
    answer::write(&query(), &slots, false).unwrap()
}

fn sealed(public: &PublicKey, r: u64) -> (String, Option<Vec<u8>>) {
    let id = format!("assignment-{r}");
    let envelope = envelope::seal_with(
        &confed_enclave::hpke_awslc::AwsLc,
        public,
        KEY,
        &context(),
        &id.as_str().into(),
        &answer_of(r),
    )
    .unwrap();
    (envelope::assignment_ref(&id), Some(envelope.to_cbor()))
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
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

fn count(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Streams `reports` answers through a fresh table on 2 threads; the growth of peak RSS. Run in
/// a process of its own (`measure_in_child`): memory a run freed stays mapped in its process.
fn streamed_peak(reports: u64) -> (u64, f64) {
    let (private, _) = generate_keypair();
    reset_peak_rss();
    let before = peak_rss_bytes();
    let agg = AnalyticsAggregator::new(binding(), query(), &private).unwrap();
    let started = Instant::now();
    pool(2).install(|| {
        (0..reports).into_par_iter().for_each(|r| {
            agg.add_opened(&answer_of(r)).unwrap();
        })
    });
    let seconds = started.elapsed().as_secs_f64();
    (peak_rss_bytes().saturating_sub(before), seconds)
}

/// `streamed_peak(reports)` in a fresh copy of this benchmark: (peak RSS growth, seconds).
fn measure_in_child(reports: u64) -> (u64, f64) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .env("CONFED_BENCH_STREAM_ONLY", reports.to_string())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let mut parts = text.split_whitespace();
    let bytes = parts.next().and_then(|b| b.parse().ok()).unwrap_or(0);
    let seconds = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0.0);
    (bytes, seconds)
}

fn main() {
    if let Ok(reports) = std::env::var("CONFED_BENCH_STREAM_ONLY") {
        let (bytes, seconds) = streamed_peak(reports.parse().unwrap());
        println!("{bytes} {seconds}");
        return;
    }
    let reports = count("CONFED_BENCH_REPORTS", 100_000);
    let streamed = count("CONFED_BENCH_STREAMED", 10_000_000);
    let (private, public) = generate_keypair();
    let started = Instant::now();
    let mut inputs: Vec<(String, Option<Vec<u8>>)> = pool(2).install(|| {
        (0..reports)
            .into_par_iter()
            .map(|r| sealed(&public, r))
            .collect()
    });
    // In ref order, as a round's committed inputs are (partitions are ranges of it).
    inputs.sort();
    let mut whole_result = Vec::new();
    let bytes: usize = inputs
        .iter()
        .map(|(_, b)| b.as_ref().map_or(0, Vec::len))
        .sum();
    println!(
        "analytics: {reports} sealed reports of {KEYS} keys from a domain of {DOMAIN} words ({} bytes each), made in {:.1} s",
        bytes / reports as usize,
        started.elapsed().as_secs_f64()
    );
    let mut per_thread = Vec::new();
    for threads in [1, 2] {
        let agg = AnalyticsAggregator::new(binding(), query(), &private).unwrap();
        let started = Instant::now();
        pool(threads).install(|| agg.add_batch(&inputs));
        let seconds = started.elapsed().as_secs_f64();
        assert_eq!(agg.counts(), (reports as usize, 0));
        let rate = reports as f64 / seconds;
        per_thread.push(rate);
        println!(
            "analytics: opened and added on {threads} thread(s): {rate:.0} reports/s ({:.0} per core)",
            rate / threads as f64
        );
        if threads == 2 {
            let mut policy = TaskPolicy::sample("bench-task", 1);
            policy.analytics = Some(query());
            policy.report_goal = reports as u32;
            policy.min_reports = 1;
            let params = AnalyticsParams::for_policy(&policy).unwrap().unwrap();
            let started = Instant::now();
            let release = agg.finish(&private, &params).unwrap();
            whole_result = release.result.clone();
            let record = release.manifest.analytics.unwrap();
            println!(
                "analytics: release of {} distinct keys (noised, threshold {}, {} released, {} bytes of JSON) in {:.2} s",
                record.distinct_keys.unwrap_or_default(),
                record.threshold.unwrap_or_default(),
                record.released_keys.unwrap_or_default(),
                release.result.len(),
                started.elapsed().as_secs_f64()
            );
        }
    }
    println!(
        "analytics: 1 -> 2 threads: x{:.2}",
        per_thread[1] / per_thread[0]
    );
    partitioned(&private, &inputs, &whole_result);
    // The HPKE open alone (envelope parse, X25519, AES-128-GCM), one thread: the bound.
    let recipient = confed_enclave::hpke_awslc::Recipient::new(&private).unwrap();
    let mut plaintext = Vec::new();
    let started = Instant::now();
    for (assignment_ref, stored) in &inputs {
        let stored = stored.as_deref().unwrap();
        let parsed = confed_protocol::envelope::EnvelopeRef::parse(stored).unwrap();
        envelope::open_into(
            &recipient,
            &parsed,
            &context(),
            assignment_ref,
            &mut plaintext,
        )
        .unwrap();
    }
    println!(
        "analytics: HPKE open alone (1 thread): {:.0} reports/s",
        reports as f64 / started.elapsed().as_secs_f64()
    );
    drop(inputs);
    // The table alone: answers already opened (what the HPKE open leaves).
    let (private_only, _) = generate_keypair();
    let agg = AnalyticsAggregator::new(binding(), query(), &private_only).unwrap();
    let opened: Vec<Vec<u8>> = (0..reports).map(answer_of).collect();
    let started = Instant::now();
    pool(1).install(|| opened.iter().for_each(|a| agg.add_opened(a).unwrap()));
    println!(
        "analytics: the table alone (answers read and added, 1 thread): {:.0} reports/s",
        reports as f64 / started.elapsed().as_secs_f64()
    );
    drop((agg, opened));
    let tenth = (streamed / 10).max(1);
    let (small, _) = measure_in_child(tenth);
    let (large, seconds) = measure_in_child(streamed);
    println!(
        "analytics: peak memory growth streaming {tenth} reports: {:.0} MiB; {streamed} reports: {:.0} MiB ({:.1} s, {:.0} reports/s on 2 threads without HPKE): bounded by the {DOMAIN} keys, not the reports",
        small as f64 / (1 << 20) as f64,
        large as f64 / (1 << 20) as f64,
        seconds,
        streamed as f64 / seconds
    );
}

/// The round in 2 partitions, each opened on 2 threads and sealed (padded to its range's most
/// keys), then the root's merge of both and its release, which must be the one worker's bytes.
fn partitioned(
    private: &confed_enclave::hpke::PrivateKey,
    inputs: &[(String, Option<Vec<u8>>)],
    whole_result: &[u8],
) {
    const COUNT: u32 = 2;
    let listing: Vec<Input> = inputs
        .iter()
        .map(|(assignment_ref, _)| Input {
            assignment_ref: assignment_ref.clone(),
            blob_key: String::new(),
            digest: None,
            retained: None,
        })
        .collect();
    let mut sealed = Vec::new();
    let (mut opening, mut sealing) = (0.0, 0.0);
    for index in 0..COUNT {
        let partition = Partition {
            inputs: &listing,
            index,
            count: COUNT,
        };
        let range = confed_enclave::aggregate::partition::ranges(inputs.len(), COUNT).unwrap()
            [index as usize]
            .clone();
        let agg = AnalyticsAggregator::new(binding(), query(), private).unwrap();
        let started = Instant::now();
        pool(2).install(|| agg.add_batch(&inputs[range]));
        opening += started.elapsed().as_secs_f64();
        let started = Instant::now();
        sealed.push(agg.seal_partition(private, &partition).unwrap());
        sealing += started.elapsed().as_secs_f64();
    }
    let root = AnalyticsAggregator::new(binding(), query(), private).unwrap();
    let started = Instant::now();
    let mut merge = root.start_merge(listing.len(), COUNT).unwrap();
    for bytes in &sealed {
        root.merge_one(&mut merge, private, &listing, bytes)
            .unwrap();
    }
    merge.end().unwrap();
    let merging = started.elapsed().as_secs_f64();
    let mut policy = TaskPolicy::sample("bench-task", 1);
    policy.analytics = Some(query());
    policy.report_goal = inputs.len() as u32;
    policy.min_reports = 1;
    let params = AnalyticsParams::for_policy(&policy).unwrap().unwrap();
    let release = root.finish(private, &params).unwrap();
    assert!(
        release.result == whole_result,
        "the partitioned release differs"
    );
    println!(
        "analytics: {COUNT} partitions: opened in {opening:.2} s, sealed ({} MB each, padded) in {sealing:.2} s, merged by the root in {merging:.2} s ({:.0} reports/s); the release is the one worker's bytes",
        sealed[0].len() / 1_000_000,
        inputs.len() as f64 / merging
    );
}
