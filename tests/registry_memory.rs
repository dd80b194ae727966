//! The recent-devices registry is bounded by bytes: its estimate of what it holds must not be
//! under what the allocator actually gave it (an estimate 2.3 times too low once let a 64 MiB
//! budget hold ~150 MB). Measured with a counting global allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use confed::registry::{Attributes, DeviceRegistry};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::SeqCst);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn the_registry_holds_no_more_than_it_counts() {
    let attributes: Attributes = serde_json::from_value(serde_json::json!(
        {"os": "android", "ram_gb": 8, "charging": true, "unmetered": true}
    ))
    .unwrap();
    let registry = DeviceRegistry::new(60_000, 1_000_000, 8 << 20);
    // Each clone is converted and dropped inside `record`: what stays allocated afterwards is
    // what the registry holds (entries and its queue's buffer).
    let before = LIVE.load(Ordering::SeqCst);
    for i in 0..50_000 {
        registry.record("phones.en", vec![1, 4, 0], attributes.clone(), i);
    }
    let held = LIVE.load(Ordering::SeqCst) - before;
    let counted = registry.bytes() as isize;
    assert!(counted <= 8 << 20, "within its budget: {counted}");
    // What the registry holds: its entries plus the queue's buffer (counted per entry).
    assert!(
        held <= counted + counted / 2,
        "the allocator holds {held} bytes for entries counted as {counted}"
    );
}
