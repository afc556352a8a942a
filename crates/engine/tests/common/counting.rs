//! A global allocator that counts this thread's heap allocations while asked
//! ([`allocations`]), outside a CPU kernel's scratch (the gemm crate's packing, attention's
//! tiles: `kernels::cpu::scratch`). Included by a test binary with
//! `#[path = "common/counting.rs"] mod counting;`, which makes it that binary's allocator
//! (not in `common`: every test binary would get it).

use ferrotron_engine::kernels::cpu::scratch::in_kernel_scratch;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

struct Counting;

/// `HOT_PATH_TRACE=1`: print where each counted allocation was made (needs line tables).
static TRACE: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Heap allocations made by this thread while `COUNTING` is set.
    static COUNT: Cell<usize> = const { Cell::new(0) };
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

/// Counts an allocation of this thread's outside a kernel's scratch (the gemm crate's packing,
/// attention's tiles: see `kernels::cpu::scratch`).
fn count(bytes: usize) {
    if !COUNTING.with(|c| c.get()) || in_kernel_scratch() {
        return;
    }
    COUNT.with(|n| n.set(n.get() + 1));
    if TRACE.load(Ordering::Relaxed) {
        COUNTING.with(|c| c.set(false));
        let trace = std::backtrace::Backtrace::force_capture().to_string();
        let ours = trace.lines().filter(|l| l.contains("ferrotron"));
        eprintln!(
            "{bytes} B at {}",
            ours.take(6).collect::<Vec<_>>().join(" <")
        );
        COUNTING.with(|c| c.set(true));
    }
}

// SAFETY: forwards to the system allocator; the thread-local cells are const-initialised, so
// touching them never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count(l.size());
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, size: usize) -> *mut u8 {
        count(size);
        System.realloc(p, l, size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Heap allocations `f` makes on this thread.
pub fn allocations(f: impl FnOnce()) -> usize {
    TRACE.store(
        std::env::var_os("HOT_PATH_TRACE").is_some(),
        Ordering::Relaxed,
    );
    COUNT.with(|n| n.set(0));
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    COUNT.with(|n| n.get())
}
