//! ferrotron-train: the trainer of every layout (dp, tp/sp, pp, cp, ep, ZeRO-1/2/3), its ranks as
//! threads or mpirun processes, on the CPU or a GPU: data, the step, checkpoints, sampling.
//! Grouped by concern: `memory/` (allocator, arena, pool, timeline), `optim/` (schedule, loss
//! scale, the update), `observe/` (metrics, trace, report, TensorBoard), `data/`,
//! `checkpoint/`; one file per parallel group beside them.

pub mod checkpoint;
pub mod config;
pub mod context_parallel;
pub mod data;
pub mod data_parallel;
pub mod device;
pub mod eval;
pub mod expert_parallel;
pub mod fit;
pub mod grad_sync;
pub mod group;
pub mod memory;
pub mod mesh;
pub mod observe;
pub mod offload_params;
pub mod optim;
pub mod pipeline;
pub mod pp_auto;
pub mod run;
pub mod sample;
pub mod setup;
pub mod small_sums;
pub mod tensor_parallel;
pub mod trainer;
pub mod weights;
pub mod zero2;
pub mod zero3;

// The paths other crates and the tests name (and branches in flight use) from before the
// modules were grouped by concern.
pub use memory::{alloc, timeline};
pub use observe::{metrics, report, tensorboard};
pub use optim::loss_scale;
