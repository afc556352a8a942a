//! The CUDA backend (`--features cuda`; issue #14): the kernel interface on one NVIDIA GPU.
//!
//! - `source`: the CUDA C++ kernels (`cu/`), compiled at run time by NVRTC for the GPU found.
//! - `device`: the driver, a context and stream, and the compiled program, with one clear
//!   error for each thing that can be missing.
//! - `compute_stream`: the stream the backend's work runs on (each thread's own: CUDA graphs
//!   cannot capture the legacy default stream).
//! - `ptx_version`: the compiled program's PTX ISA against the driver's CUDA version.
//!
//! cudarc loads the driver, NVRTC and cuBLASLt at run time (`dynamic-loading`), so this
//! builds with no CUDA toolkit and a machine without a GPU runs the CPU backend as before.

pub mod backend;
pub mod compute_stream;
pub mod device;
pub mod gemm;
pub mod libs;
pub mod memory;
pub mod ptx_version;
pub mod skip;
pub mod source;
pub mod staging;

/// cudarc itself, for the crates above the engine that reach the GPU (the NCCL communicator).
pub use cudarc;

pub use backend::{CapturedWork, CudaKernels};
pub use device::{DeviceError, Gpu};
pub use memory::{download, upload, CudaAlloc, CudaPool, DeviceBlock};
pub use staging::CudaCopy;

use crate::kernels::device_ops::{DeviceOps, OpCounter};

/// What the CUDA backend asked of the driver in this process (`kernels::device_ops`): every
/// host synchronisation by site, launch, cuBLASLt call and device copy, counted where it is
/// made. One counter for the process: host-staged ranks sharing the GPU add to the same.
pub static OPS: OpCounter = OpCounter::new();

/// [`OPS`] now.
pub fn ops() -> DeviceOps {
    OPS.read()
}
