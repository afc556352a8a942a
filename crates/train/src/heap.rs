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
        unsafe { mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, i32::MAX) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
