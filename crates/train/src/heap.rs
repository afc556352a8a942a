//! Keeps freed pages mapped for reuse (glibc only), so a steady-state step does not fault its
//! memory in again.
//!
//! Every micro-batch allocates the rank's activation arena (`arena.rs`) and frees it at the end
//! of its backward, as the memory plan says. With glibc's defaults a block above the dynamic
//! mmap threshold (at most 32 MiB) is a fresh `mmap` each time and `munmap`ed on free, and the
//! top of the heap is trimmed back to the kernel: each micro-batch would then touch its
//! hundreds of MiB as new pages (about 27,000 minor page faults a step on the default model).
//! Serving every block from the heap (no mmap) and never trimming keeps those pages in the
//! process, where the next micro-batch's arena finds them: under a hundred faults a step
//! (docs/BENCHMARKS.md). The tracking allocator, which counts requested bytes, measures exactly
//! what the plan says; the resident set keeps the freed region between micro-batches, as a
//! caching allocator would.

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether [`keep_freed_pages`] took (and is in force).
#[cfg_attr(not(all(target_os = "linux", target_env = "gnu")), allow(dead_code))]
static KEEPING: AtomicBool = AtomicBool::new(false);

/// Sets glibc's allocator to keep freed pages (see the module comment). Returns whether it took.
pub fn keep_freed_pages() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // <malloc.h>: M_TRIM_THRESHOLD -1, M_MMAP_MAX -4.
        extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_MAX: i32 = -4;
        // SAFETY: mallopt only changes allocator tunables; it is safe to call at any time.
        let took =
            unsafe { mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, i32::MAX) == 1 };
        KEEPING.store(took, Ordering::Relaxed);
        took
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Runs `f` under glibc's default allocator settings (large blocks mmapped and unmapped when
/// freed, the heap top trimmed), then hands every freed page of every arena back to the kernel
/// (`malloc_trim(0)`) and keeps freed pages again if it did before.
///
/// For work before training that frees what it allocates, such as tokenizing the bundled
/// corpus: under [`keep_freed_pages`] its transient memory stayed resident for the whole run,
/// in the arena of each rayon worker that encoded a piece, never reused by the trainer's own
/// allocations — peak RSS was the plan plus the tokenizer's high-water mark in every worker's
/// arena, so it grew with the core count and with which workers happened to get work (#34).
pub fn with_default_malloc<T>(f: impl FnOnce() -> T) -> T {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
            fn malloc_trim(pad: usize) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_MAX: i32 = -4;
        // glibc's defaults (mallopt(3)): 65536 mmapped blocks, trim above 128 KiB.
        const DEFAULT_MMAP_MAX: i32 = 65536;
        const DEFAULT_TRIM_THRESHOLD: i32 = 128 * 1024;
        // glibc cannot be asked for its settings: `KEEPING` remembers whether
        // `keep_freed_pages` is in force, to put it back afterwards.
        // SAFETY: mallopt and malloc_trim only change allocator tunables and release free pages.
        unsafe {
            mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX);
            mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD);
        }
        let out = f();
        unsafe {
            malloc_trim(0);
        }
        if KEEPING.load(Ordering::Relaxed) {
            keep_freed_pages();
        }
        out
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        f()
    }
}
