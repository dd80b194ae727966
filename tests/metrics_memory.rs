//! Histogram samples were kept until /metrics was scraped: unscraped, a server under load grew
//! by ~2 MB a minute (the soak found it). The recorder's upkeep folds them into buckets; this
//! measures with a counting allocator that it frees them.

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

fn record(samples: u32) {
    for i in 0..samples {
        metrics::histogram!("http_request_duration_seconds", "route" => "/test")
            .record(f64::from(i % 100) / 1000.0);
    }
}

#[test]
fn histogram_samples_are_folded_away_without_a_scrape() {
    let handle = confed::api::ops::prometheus();
    let samples = 200_000;
    let before = counting_alloc::live();
    record(samples);
    let one_batch = counting_alloc::live() - before;
    assert!(
        one_batch > 4 * samples as isize,
        "samples are held: {one_batch} bytes"
    );
    // Ten more batches, each followed by the upkeep the server runs every few seconds: the
    // buckets' blocks are reclaimed (epoch-based, so a batch or two later), not accumulated.
    for _ in 0..10 {
        handle.run_upkeep();
        record(samples);
    }
    handle.run_upkeep();
    let held = counting_alloc::live() - before;
    assert!(
        held < 3 * one_batch,
        "{held} bytes held after eleven batches of {one_batch}"
    );
    let text = handle.render();
    assert!(
        text.contains("http_request_duration_seconds_count{route=\"/test\"} 2200000"),
        "every sample still counted"
    );
}
