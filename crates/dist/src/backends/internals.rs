//! A communication backend's own transient allocations, marked as the kernels' scratch is
//! (`ferrotron_engine::kernels::cpu::scratch`). A real MPI or NCCL library allocates inside a
//! collective too (requests, protocol buffers, its progress engine's queues), out of the
//! trainer's sight and out of its plan; the threads backend, which stands in for one, does the
//! same with its job queue, its completion channel and the copies its blocking collectives
//! make. The trainer's step hot-path test (`ferrotron-train`'s `tests/step_hot_path.rs`)
//! allows those and counts every other allocation a step makes: the dimensions' own
//! bookkeeping (buckets, shards, groups, the mesh) must allocate nothing per step.

use ferrotron_engine::kernels::cpu::scratch::Scope;
use std::cell::Cell;

thread_local! {
    /// Backend scopes open on this thread.
    static OPEN: Cell<u32> = const { Cell::new(0) };
}

/// Whether this thread is inside a communication backend's own work.
pub fn in_backend_internals() -> bool {
    Scope::open(&OPEN)
}

/// Marks this thread's allocations as the backend's own while the scope it enters lives.
pub(crate) struct BackendInternals;

impl BackendInternals {
    pub(crate) fn enter() -> Scope {
        Scope::enter(&OPEN)
    }
}
