//! The CPU kernels' own transient scratch: the gemm crate packs its operands into heap
//! buffers on every product, and attention stages its tiles in buffers each parallel task
//! makes. Both are the kernels' workspace, alive only inside the op (as cuBLAS's and
//! FlashAttention's are on a GPU); the plan counts the products' as measured kernel workspace
//! (`ferrotron_train::memory::workspace`). Every other allocation on the hot path would be
//! memory no plan lists, so the engine's hot-path test (`tests/hot_path.rs`) counts the heap
//! allocations made outside these scopes, and there must be none.
//!
//! Kept per call rather than per thread: tiles kept between calls would stay allocated in
//! every worker thread through the rest of the step, raising its peak (measured: +2% on a
//! tensor-parallel rank of the small test model) for no saving the plan would see.

use std::cell::Cell;

thread_local! {
    /// Kernel scratch scopes open on this thread.
    static OPEN: Cell<u32> = const { Cell::new(0) };
}

/// Whether this thread is inside a kernel's scratch scope. (Reading it never allocates, so a
/// global allocator may ask.)
pub fn in_kernel_scratch() -> bool {
    OPEN.with(|c| c.get() > 0)
}

/// Marks this thread's allocations as a kernel's scratch while it lives.
pub(crate) struct KernelScratch(());

impl KernelScratch {
    pub(crate) fn enter() -> Self {
        OPEN.with(|c| c.set(c.get() + 1));
        KernelScratch(())
    }
}

impl Drop for KernelScratch {
    fn drop(&mut self) {
        OPEN.with(|c| c.set(c.get() - 1));
    }
}
