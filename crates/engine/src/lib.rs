//! ferrotron-engine: kernels (one trait; CPU and CUDA backends) and the Llama model
//! (forward + backward, llm.c style named activation buffers).

pub mod dtype;
pub mod kernels;
pub mod model;
pub mod numerics;
pub mod peak;

pub use dtype::Elem;
pub use kernels::{CpuKernels, Kernels};
pub use peak::measure_matmul_peak_gflops;
