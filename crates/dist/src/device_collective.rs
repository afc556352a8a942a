//! The model groups' collectives on the device itself (issue #33): where every rank of a
//! tensor- or context-parallel group has a GPU of its own and NCCL, the group's exchanges run
//! on the tensors where they lie, on NCCL's stream ordered against the compute stream by
//! events, instead of device → host buffer → host communicator → device. The host does not
//! wait for them: a layer's exchanges cost the host no round trip.
//! - Tensor parallelism: the all-reduces, all-gathers and reduce-scatters (Megatron's `f` and
//!   `g`, sequence parallelism's gathers and scatters, the vocabulary-parallel cross-entropy's
//!   statistics), in the activations' own type.
//! - Context parallelism: the ring's pass of each f32 key/value block to the next rank and of
//!   the previous rank's into the next buffer, as one NCCL group of a send and a receive, which
//!   starts as soon as the block is ready and runs beside the attention of the block in hand
//!   (Liu et al. 2023's overlap), the compute stream waiting for it only before the next step.
//! - Expert parallelism: the routed rows' all-to-all (dispatch and combine, forward and
//!   backward) between the f32 blocks where they lie, as one NCCL group of sends and receives;
//!   the row counts, which the host knows from the routing, still go through the host.
//!
//! f32 activations are summed in f32, as the host-staged buffer sums them: the same bits.
//! bf16 activations are summed by NCCL in bf16: each addition in f32 rounded to bf16, which at
//! two ranks is the staged path's one rounding, and at t ranks up to t − 1 roundings (as
//! Megatron-LM's bf16 all-reduces round), where the staged path adds in f32 and rounds once.
//! Other types (fp16's activations) are staged as before.

use crate::communicator::{Result, View, ViewMut};
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
    /// The ring's block is ready (the device work issued so far wrote it): the next
    /// [`DeviceCollective::ring_pass`] sends it from this point.
    fn ring_ready(&self) -> Result<()>;
    /// `send` (`n` f32 of this GPU's memory, ready since [`DeviceCollective::ring_ready`]) to
    /// rank + 1 and the previous rank's `n` into `recv`, beside the work issued since; the
    /// compute stream's next work after both. Neither is touched by the device's work between
    /// `ring_ready` and the next work issued.
    fn ring_pass(&self, send: *const f32, recv: *mut f32, n: usize) -> Result<()>;
    /// Expert parallelism's exchange: `send`'s blocks of `send_counts` elements to each rank,
    /// each rank's block of `recv_counts` into `recv`, rank order, in the compute stream's
    /// order (the host does not wait).
    fn all_to_all_v(
        &self,
        send: View<'_, f32>,
        send_counts: &[usize],
        recv: ViewMut<'_, f32>,
        recv_counts: &[usize],
    ) -> Result<()>;
}
