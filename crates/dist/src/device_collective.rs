//! The model groups' collectives on the device itself (issue #33): where every rank of a
//! tensor-parallel group has a GPU of its own and NCCL, the group's all-reduces, all-gathers
//! and reduce-scatters (Megatron's `f` and `g`, sequence parallelism's gathers and scatters,
//! the vocabulary-parallel cross-entropy's statistics) run on the activations where they lie,
//! in their own type, on NCCL's stream ordered against the compute stream by events, instead
//! of device → host buffer → host communicator → device. The host does not wait for them: a
//! tensor-parallel layer's collectives cost the host no round trip.
//!
//! f32 activations are summed in f32, as the host-staged buffer sums them: the same bits.
//! bf16 activations are summed by NCCL in bf16: each addition in f32 rounded to bf16, which at
//! two ranks is the staged path's one rounding, and at t ranks up to t − 1 roundings (as
//! Megatron-LM's bf16 all-reduces round), where the staged path adds in f32 and rounds once.
//! Other types (fp16's activations) are staged as before.

use crate::communicator::Result;
use ferrotron_engine::model::tensor_parallel::TpOp;
use ferrotron_engine::model::DeviceOperands;
use ferrotron_plan::DType;

/// A group's collectives on device operands (NCCL).
pub trait DeviceCollective {
    /// Whether it runs collectives on elements of `dtype`.
    fn takes(&self, dtype: DType) -> bool;
    /// Runs `op` on `x` after the device work issued so far, the compute stream's next work
    /// after it; the host does not wait.
    fn run(&self, op: TpOp, x: DeviceOperands) -> Result<()>;
}
