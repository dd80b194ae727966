//! The recent-devices registry is bounded by bytes: its estimate of what it holds must not be
//! under what the allocator actually gave it (an estimate 2.3 times too low once let a 64 MiB
//! budget hold ~150 MB). Measured with a counting global allocator.

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

use confed::registry::{Attributes, DeviceRegistry};

#[test]
fn the_registry_holds_no_more_than_it_counts() {
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
            i,
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
