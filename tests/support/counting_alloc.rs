//! A global allocator that counts the bytes live, for tests that hold a component to a memory
//! bound. Each test binary that includes it (`#[path]`) installs it as its allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

pub(crate) struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

/// Bytes allocated and not yet freed, process-wide.
pub(crate) fn live() -> isize {
    LIVE.load(Ordering::SeqCst)
}

/// The most bytes live at once since the last `reset_peak`.
#[allow(dead_code)]
pub(crate) fn peak() -> isize {
    PEAK.load(Ordering::SeqCst)
}

/// Starts a new peak from what is live now.
#[allow(dead_code)]
pub(crate) fn reset_peak() {
    PEAK.store(live(), Ordering::SeqCst);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live =
            LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst) + layout.size() as isize;
        PEAK.fetch_max(live, Ordering::SeqCst);
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
