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
use std::thread::LocalKey;

/// While it lives, this thread's allocations are of the kind `key` counts (the number of such
/// scopes open on each thread), which a hot-path test's allocator asks with [`Scope::open`]:
/// the kernels' scratch here, a communication backend's internals
/// (`ferrotron_dist::backends::internals`).
pub struct Scope(&'static LocalKey<Cell<u32>>);

impl Scope {
    pub fn enter(key: &'static LocalKey<Cell<u32>>) -> Self {
        key.with(|c| c.set(c.get() + 1));
        Scope(key)
    }

    /// Whether a scope of `key` is open on this thread. (Reading it never allocates, so a
    /// global allocator may ask.)
    pub fn open(key: &'static LocalKey<Cell<u32>>) -> bool {
        key.with(|c| c.get() > 0)
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        self.0.with(|c| c.set(c.get() - 1));
    }
}

thread_local! {
    /// Kernel scratch scopes open on this thread.
    static OPEN: Cell<u32> = const { Cell::new(0) };
}

/// Whether this thread is inside a kernel's scratch scope.
pub fn in_kernel_scratch() -> bool {
    Scope::open(&OPEN)
}

/// Marks this thread's allocations as a kernel's scratch while the scope it enters lives.
pub(crate) struct KernelScratch;

impl KernelScratch {
    pub(crate) fn enter() -> Scope {
        Scope::enter(&OPEN)
    }
}
