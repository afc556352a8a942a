//! ferrotron-train: the trainer of every layout (dp, tp/sp, pp, cp, ep, ZeRO-1/2/3), its ranks as
//! threads or mpirun processes, on the CPU or a GPU: data, the step, checkpoints, sampling.
//! Grouped by concern: `memory/` (allocator, arena, pool, timeline), `optim/` (schedule, loss
//! scale, the update), `observe/` (metrics, trace, report, TensorBoard), `data/`,
//! `checkpoint/`; `device/` (which device, the state on it, several ranks' staging, NCCL).
//! The parallel dimensions (data, ZeRO, tensor, pipeline, expert and context parallelism),
//! their mesh of groups and the communicators are `ferrotron-dist`'s; the trainer builds the
//! mesh from the plan and runs the step through it.

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod device;
pub mod eval;
pub mod fit;
pub mod memory;
pub mod observe;
pub mod offload_params;
pub mod optim;
pub mod pp_auto;
pub mod run;
pub mod sample;
pub mod setup;
pub mod trainer;
pub mod weights;

// The paths other crates and the tests name (and branches in flight use) from before the
// modules were grouped by concern.
pub use memory::{alloc, timeline};
pub use observe::{metrics, report, tensorboard};
pub use optim::loss_scale;
