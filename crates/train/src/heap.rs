//! Keeps freed activation pages mapped for reuse (glibc only), so a steady-state step does not
//! fault its buffers in again.
//!
//! Every step allocates its activations and frees them in the backward. With glibc's defaults a
//! buffer above the dynamic mmap threshold is a fresh `mmap` each time and `munmap`ed on free,
//! and the top of the heap is trimmed back to the kernel: each step then touches its ~500 MiB of
//! buffers as new pages, about 27,000 minor page faults a step on the default model. Raising the
//! mmap threshold to glibc's maximum (32 MiB on 64-bit, above every activation buffer of the
//! default model) and never trimming keeps those pages in the heap, where the next step's
//! buffers of the same sizes find them: about 100 faults a step (docs/BENCHMARKS.md). Peak RSS
//! does not change (the same bytes are live at the peak), and the tracking allocator, which
//! counts requested bytes, measures exactly what it measured before. The arena of the engine
//! redesign (#10) will make this unnecessary by allocating one slab per rank from the plan.

/// Sets glibc's allocator to keep freed pages (see the module comment). Returns whether it took.
pub fn keep_freed_pages() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // <malloc.h>: M_TRIM_THRESHOLD -1, M_TOP_PAD -2, M_MMAP_THRESHOLD -3.
        extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        // glibc refuses thresholds above HEAP_MAX_SIZE / 2 = 32 MiB on 64-bit.
        const MAX_MMAP_THRESHOLD: i32 = 32 << 20;
        // SAFETY: mallopt only changes allocator tunables; it is safe to call at any time.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD) == 1
                && mallopt(M_TRIM_THRESHOLD, i32::MAX) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
