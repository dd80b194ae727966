#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! Memory bounds, measured with a counting global allocator (one binary, the tests one at a
//! time: the allocator counts the whole process).
//!
//! - The recent-devices registry is bounded by bytes: its estimate of what it holds must not be
//!   under what the allocator actually gave it (an estimate 2.3 times too low once let a 64 MiB
//!   budget hold ~150 MB).
//! - Histogram samples were kept until /metrics was scraped: unscraped, a server under load grew
//!   by ~2 MB a minute (the soak found it). The recorder's upkeep folds them into buckets.
//! - A model upload was read whole into memory (and copied again by the local store): a 512 MiB
//!   model cost twice that in RSS. It is spooled to a temporary file as it arrives.

mod common;
#[path = "support/counting_alloc.rs"]
mod counting_alloc;

use confed::clock::Millis;
use confed::registry::{Attributes, DeviceRegistry};

/// The tests measure the whole process: one at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn the_registry_holds_no_more_than_it_counts() {
    let _serial = serial();
    let attributes: Attributes = serde_json::from_value(serde_json::json!(
        {"os": "android", "ram_gb": 8, "charging": true, "unmetered": true}
    ))
    .unwrap();
    let registry = DeviceRegistry::new(60_000, 1_000_000, 8 << 20);
    // Each clone is converted and dropped inside `record`: what stays allocated afterwards is
    // what the registry holds (entries and its queue's buffer).
    let before = counting_alloc::live();
    for i in 0..50_000 {
        registry.record(
            "phones.en",
            vec![1, 4, 0],
            attributes.clone(),
            "assigned",
            Millis(i),
        );
    }
    let held = counting_alloc::live() - before;
    let counted = registry.bytes() as isize;
    assert!(counted <= 8 << 20, "within its budget: {counted}");
    // What the registry holds: its entries plus the queue's buffer (counted per entry).
    assert!(
        held <= counted + counted / 2,
        "the allocator holds {held} bytes for entries counted as {counted}"
    );
}

fn record(recorder: &metrics_exporter_prometheus::PrometheusRecorder, samples: u32) {
    metrics::with_local_recorder(recorder, || {
        for i in 0..samples {
            metrics::histogram!("http_request_duration_seconds", "route" => "/test")
                .record(f64::from(i % 100) / 1000.0);
        }
    });
}

#[test]
fn histogram_samples_are_folded_away_without_a_scrape() {
    let _serial = serial();
    // The server's recorder, but local to this test: the global one's upkeep thread would fold
    // samples whenever it wakes, racing the first measurement. Upkeep runs here when told to.
    let recorder = confed::api::ops::recorder();
    let handle = recorder.handle();
    let samples = 200_000;
    let before = counting_alloc::live();
    record(&recorder, samples);
    let one_batch = counting_alloc::live() - before;
    assert!(
        one_batch > 4 * samples as isize,
        "samples are held: {one_batch} bytes"
    );
    // Ten more batches, each followed by the upkeep the server runs every few seconds: the
    // buckets' blocks are reclaimed (epoch-based, so a batch or two later), not accumulated.
    for _ in 0..10 {
        handle.run_upkeep();
        record(&recorder, samples);
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

/// A 64 MiB model sent in 1 MiB chunks (no Content-Length): the server never holds more than a
/// few MiB of it at once. Before, the body was collected whole and the local store copied it
/// again: at least 128 MiB live.
#[test]
fn a_64_mib_model_upload_is_never_held_whole_in_memory() {
    let _serial = serial();
    const CHUNK: usize = 1 << 20;
    const CHUNKS: usize = 64;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let app = common::TestApp::new().await;
        let token = app.tenant("acme").await;
        let id = app.create_task(&token, serde_json::json!({})).await;
        // safetensors: an 8-byte little-endian header length, the JSON header (padded to 8),
        // then one F32 tensor of zeros, produced a chunk at a time.
        let values = CHUNK * CHUNKS / 4;
        let mut header = format!(
            r#"{{"w":{{"dtype":"F32","shape":[{values}],"data_offsets":[0,{}]}}}}"#,
            values * 4
        )
        .into_bytes();
        while header.len() % 8 != 0 {
            header.push(b' ');
        }
        let mut head = (header.len() as u64).to_le_bytes().to_vec();
        head.extend_from_slice(&header);
        let chunks = std::iter::once(head)
            .chain((0..CHUNKS).map(|_| vec![0u8; CHUNK]))
            .map(|c| Ok::<_, std::io::Error>(bytes::Bytes::from(c)));
        let request = axum::http::Request::builder()
            .method("PUT")
            .uri(format!("/v1/tasks/{id}/model"))
            .header("authorization", format!("Bearer {token}"))
            .header("content-type", "application/octet-stream")
            .body(axum::body::Body::from_stream(futures_util::stream::iter(
                chunks,
            )))
            .unwrap();
        counting_alloc::reset_peak();
        let before = counting_alloc::live();
        let reply = app.send(request).await;
        let held = counting_alloc::peak() - before;
        assert_eq!(
            reply.status,
            axum::http::StatusCode::CREATED,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        assert!(
            held < 16 << 20,
            "{} MiB live at once during a 64 MiB upload",
            held >> 20
        );
        // And it is all there, byte for byte.
        let model = app
            .call(
                axum::http::Method::GET,
                &format!("/v1/tasks/{id}/models/0"),
                Some(&token),
                None,
            )
            .await;
        assert_eq!(model.body.len(), 8 + header.len() + CHUNK * CHUNKS);
    });
}
