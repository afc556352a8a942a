//! The communicators the dimensions run on: [`threads`] (ranks as threads of one process, for
//! one machine and for tests), with the `mpi` feature [`mpi`] (one process per rank, launched
//! by `mpirun`), [`staged`], which makes either take device views through a host staging
//! buffer, and with the `cuda` feature [`nccl`] (device views of one GPU each, through NCCL on
//! the engine's CUDA backend).

mod host_side;
pub mod internals;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod staged;
pub mod threads;
