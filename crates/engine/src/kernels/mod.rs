//! The kernel interface: every op the model needs, forward and backward (`interface.rs`:
//! the list of ops and the [`Kernels`] trait; `shapes.rs`: what they take), and its backends.
//!
//! The model (`crate::model`) calls only this trait, so a CUDA backend can implement the same
//! trait without touching the model code. Ops take device-neutral views ([`View`],
//! [`ViewMut`]: crate `ferrotron-view`) of buffers in whatever memory the backend runs on, never host
//! slices; math is f32; tensors are stored as the trait's element types (f32, bf16, f16; see
//! [`crate::dtype`]); each op takes a small shape struct so that adding strides later extends a
//! struct instead of every signature.
//!
//! Layout conventions (HF Llama / PyTorch):
//! - Linear weights are `[out_features, in_features]` row-major (`nn.Linear`), so `y = x·Wᵀ + b`.
//! - Activations are token-major: `[N, C]` with `N = B·T`; attention q is `[B, T, H, D]`,
//!   k and v are `[B, T, KV, D]`, exactly as the projections produce them.
//! - Backward ops *accumulate* into parameter gradients (gradient accumulation relies on it);
//!   activation gradients take an explicit [`Accum`] flag.

pub mod backend;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device_check;
pub mod device_copy;
pub mod device_memory;
pub mod device_ops;
pub mod event_log;
pub mod host_copy;
mod interface;
pub mod observe;
pub mod profile;
mod shapes;
pub mod transfer_count;
/// The views live in their own crate (`crates/view`) so that communicators (`ferrotron-dist`)
/// take the same ones without depending on the engine.
pub use ferrotron_view as view;

pub use crate::dtype::Elem;
pub use backend::Backend;
pub use cpu::{CpuKernels, Gemm};
pub use device_check::{emulated, emulated_mut, DevicePool, OnDevice};
pub use device_memory::{DeviceAlloc, DeviceBuf, EmulatedDevice};
pub use device_ops::{
    watch_syncs, DeviceOps, DeviceOpsReport, DeviceSpan, SyncHook, SyncSite, SyncWatch,
};
pub use event_log::{Event, EventLog, Tracing, COMM_TRACK, DEVICE_TRACK};
pub use host_copy::HostCopy;
pub(crate) use interface::{kernel_interface, wrapper_kernels};
pub use interface::{Kernels, NO_PARAMS};
pub use observe::{Observed, OpObserver};
pub use profile::{OpTime, OpTotals, Profiled};
pub use shapes::*;
pub use view::{AsView, AsViewMut, Memory, View, ViewMut};
