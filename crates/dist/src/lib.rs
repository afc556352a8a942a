//! ferrotron-dist: how ranks talk. A [`Communicator`] trait with the collectives the
//! parallel trainers use, the rank [`Grid`] of a planner `Layout` (its groups are slices of
//! it), and backends: [`threads`] (ranks as threads of one process, for one machine and for
//! tests) and, with the `mpi` feature, `mpi` (one process per rank, launched by `mpirun`);
//! [`staged`] makes either take device views, through a host staging buffer.
//! The collectives take device-neutral views (crate `ferrotron-view`, the ones the engine's
//! kernels take), so NCCL (GPUs) will be one more backend of the same trait.

pub mod communicator;
pub mod grid;
pub mod launch;
#[cfg(feature = "mpi")]
pub mod mpi;
mod shapes;
pub mod staged;
pub mod threads;
pub mod watchdog;

pub use communicator::{
    AsView, AsViewMut, CommError, Communicator, Completion, Memory, Pending, Region, View, ViewMut,
};
pub use ferrotron_view::carve;
pub use grid::{Dim, Grid};
pub use launch::launched_by_mpirun;
pub use staged::Staged;
pub use watchdog::Watched;
