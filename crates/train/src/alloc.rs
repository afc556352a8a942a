//! A tracking global allocator: live and peak heap bytes of the whole process, so every run can
//! compare the memory it actually used with the plan's prediction.
//!
//! The binary (and each test that measures) installs it:
//! `#[global_allocator] static A: ferrotron_train::alloc::Tracking = ferrotron_train::alloc::Tracking;`

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};

pub struct Tracking;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

#[inline]
fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Relaxed) + n;
    PEAK.fetch_max(now, Relaxed);
}

// SAFETY: every call forwards to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        LIVE.fetch_sub(layout.size(), Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Relaxed);
            }
        }
        p
    }
}

/// Live heap bytes now (0 if the tracking allocator is not installed).
pub fn live() -> u64 {
    LIVE.load(Relaxed) as u64
}

/// Highest live bytes since the last `reset_peak`.
pub fn peak() -> u64 {
    PEAK.load(Relaxed) as u64
}

/// Starts a new peak window at the current live bytes.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Relaxed), Relaxed);
}

/// Whether the tracking allocator is the global allocator of this process (probed once by an
/// allocation: if it is, the live counter moves).
pub fn installed() -> bool {
    if INSTALLED.load(Relaxed) {
        return true;
    }
    let before = LIVE.load(Relaxed);
    let probe = std::hint::black_box(vec![0u8; 4096]);
    let yes = LIVE.load(Relaxed) >= before + 4096;
    drop(probe);
    INSTALLED.store(yes, Relaxed);
    yes
}
