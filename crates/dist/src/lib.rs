//! ferrotron-dist: the parallel dimensions and how ranks talk. One file per dimension, with
//! its communication beside it: [`data_parallel`] (gradient buckets reduced while the backward
//! runs, ZeRO-1's shard), [`zero`] (ZeRO-2's gradient windows, ZeRO-3's parameter windows),
//! [`tensor_parallel`] (with sequence parallelism), [`pipeline`] (runs the planner's
//! `schedule`), [`expert_parallel`] and [`context_parallel`]; [`grad_sync`] is the one
//! interface through which a training step hands its gradients to data parallelism. The
//! [`mesh::Mesh`], built once from the planner's `Layout`, holds every group and the small
//! shared helpers (sums over chosen dimensions ([`small_sums`]), the bytes sent per dimension
//! against the plan ([`comm_bytes`])); [`group::Group`] is the one group type (communicator,
//! planned buffer, bytes, first error), of the model groups, data parallelism and the
//! pipeline. Beneath them the [`Communicator`] trait, the rank [`Grid`] of a `Layout`, and
//! the [`backends`]: [`threads`], with the `mpi` feature `mpi`, and [`staged`] (device views
//! through a host staging buffer). The collectives take
//! device-neutral views (crate `ferrotron-view`, the ones the engine's kernels take), so a GPU
//! communicator is one more backend of the same trait. Dependencies are one-way: dist uses the
//! planner and the engine's model; the trainer uses dist.

pub mod backends;
pub mod comm_bytes;
pub mod communicator;
pub mod context_parallel;
pub mod data_parallel;
pub mod device_collective;
pub mod device_p2p;
pub mod device_reduce;
pub mod expert_parallel;
pub mod grad_sync;
pub mod grid;
pub mod group;
pub mod launch;
pub mod mesh;
pub mod pipeline;
mod shapes;
pub mod small_sums;
pub mod tensor_parallel;
pub mod watchdog;
pub mod zero;

// The backends at the paths callers name (`ferrotron_dist::threads::run`, `ferrotron_dist::mpi`).
#[cfg(feature = "mpi")]
pub use backends::mpi;
#[cfg(feature = "cuda")]
pub use backends::nccl;
pub use backends::{staged, threads};
pub use communicator::{
    AsView, AsViewMut, CommError, Communicator, Completion, Memory, Pending, Region, View, ViewMut,
};
pub use ferrotron_view::carve;
pub use grid::{Dim, Grid};
pub use launch::launched_by_mpirun;
pub use staged::Staged;
pub use watchdog::Watched;
