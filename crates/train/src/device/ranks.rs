//! Several ranks on a device (`--device emulated` with `--dp`, `--tp` (`--sp`), `--pp`,
//! `--cp`, `--ep`; issue #33): the copies between a device's gradients or weights and the host
//! buckets that data parallelism reduces, and the model groups' staging.
//!
//! Data parallelism's buckets (the plan's `dp.grad_buckets`, two of `--bucket-mb`) are f32
//! host buffers already: the backward's final gradients are widened into them and their sums
//! written back, and the overlapped `*_start` collectives own them meanwhile. On a device
//! those buckets are the staging buffers of a host-staged reduction (device → host bucket →
//! threads or MPI → device), allocated once with the gradients at the plan's size: each piece
//! of gradient is copied straight from the device into its place in the bucket ([`read_f32`])
//! and each sum straight back ([`write_f32`]), so no collective sees a device view and the
//! reduction keeps its overlap with the backward. ZeRO-1's all-gather of the updated weights
//! goes through the same copies ([`ViewGather`]).
//!
//! The model's groups stage the same way, through the buffers the plan gives them: tensor
//! parallelism's all-reduces, gathers and reduce-scatters (and sequence parallelism's norm
//! sums) fill the group's `comm.tp.staging` from the device and write the result back
//! (`TpComm::device`, `ferrotron_dist::group::Group::on_device`); a pipeline stage sends from its
//! `comm.pp.send.*` buffers and receives into `comm.pp.recv`, read from and written into the
//! device (`ferrotron_dist::pipeline::Pipeline::on_device`), the tied embedding's two gradients summed
//! through the latter. Context parallelism's ring widens the keys and values into its f32
//! blocks (device buffers of the pool) through the same copies, sends each block from the
//! group's `comm.cp.message` and, on a device, receives it into a second one of the same
//! size, `comm.cp.receive`, before copying it up (the first is the send's, still in flight;
//! on the host the block is received in place): the plan counts it for device ranks
//! (`ferrotron_plan::Runtime::FerrotronDevice`).
//! `ferrotron_dist::Staged` (f32 views through a staging buffer of its own) does not serve
//! these: a 16-bit activation is summed in f32 and rounded once, so its staging is a typed
//! copy, and a second staging buffer per group would sit outside the plan. Expert
//! parallelism's blocks are f32 device buffers of the engine's (`comm.ep.send` /
//! `comm.ep.recv`), exchanged in pieces of the group's `comm.ep.message`
//! (`ferrotron_dist::expert_parallel`); a mixture of experts' routing is read back to the host through
//! the same copies (`Llama::moe_on_device`).
//!
//! A copy of a 16-bit value goes through the copier's 1 MiB stage (page-locked on a GPU, one
//! driver copy per half-million elements), widened or rounded on the host exactly as the CPU
//! path does (`Elem::to_f32`, `Elem::from_f32`: `ferrotron_engine::kernels::host_copy`), so
//! the sums and the trajectory are the CPU run's bit for bit.

use ferrotron_dist::data_parallel::{Gather, Segment};
pub use ferrotron_engine::kernels::host_copy::{read_f32, write_f32, HostCopy};
use ferrotron_engine::kernels::ViewMut;
use ferrotron_engine::Elem;
use std::ops::Range;

/// The weights around ZeRO-1's all-gather, wherever they live: this rank's blocks read from
/// them, every rank's written into them.
pub struct ViewGather<'a, 'd, S> {
    pub params: ViewMut<'a, S>,
    pub dev: Option<&'d HostCopy>,
}

impl<S: Elem> Gather for ViewGather<'_, '_, S> {
    fn own(&self, seg: &Segment, out: &mut [f32]) {
        read_f32(
            self.dev,
            self.params.as_view().slice(seg.params.clone()),
            out,
        );
    }
    fn put(&mut self, r: Range<usize>, values: &[f32]) {
        write_f32(self.dev, values, self.params.rb().slice_mut(r));
    }
}
