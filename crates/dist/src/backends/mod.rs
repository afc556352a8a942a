//! The communicators the dimensions run on: [`threads`] (ranks as threads of one process, for
//! one machine and for tests), with the `mpi` feature [`mpi`] (one process per rank, launched
//! by `mpirun`), and [`staged`], which makes either take device views through a host staging
//! buffer. The GPU's (NCCL) is the trainer's `device/nccl.rs`: it needs the engine's CUDA
//! backend, a feature of the trainer's build.

#[cfg(feature = "mpi")]
pub mod mpi;
pub mod staged;
pub mod threads;
