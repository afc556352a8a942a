//! ferrotron-dist: how ranks talk. A [`Communicator`] trait with the collectives the
//! parallel trainers use, the rank [`Grid`] of a planner `Layout` (its groups are slices of
//! it), and backends: [`threads`] (ranks as threads of one process, for one machine and for
//! tests). MPI (one process per rank) and NCCL (GPUs) implement the same trait.

pub mod communicator;
pub mod grid;
pub mod threads;

pub use communicator::{CommError, Communicator, Pending};
pub use grid::{Dim, Grid};
