//! The trainer's side of tensor parallelism (the model's is `ferrotron_engine::model::
//! tensor_parallel`): the group's communicator behind the engine's [`TpComm`], which records a
//! failed collective (a dead rank) for the trainer to report after the pass, and counts the
//! bytes each rank sends as the planner prices them; the rank's slice of the whole model's
//! weights; and the gradient norm's share of the replicated norms.

use crate::group::Group;
use crate::{Communicator, Region};
use ferrotron_engine::kernels::HostCopy;
use ferrotron_engine::model::tensor_parallel::replicated;
use ferrotron_engine::model::tensor_parallel::TpOp;
use ferrotron_engine::model::{DeviceOperands, Llama, TpComm};
use ferrotron_plan::comm::{bytes_per_rank, Collective};
use std::ops::Range;

/// Counts a collective of `elems` elements of `width` bytes as the planner prices it.
fn count(g: &Group, c: Collective, elems: usize, width: u64) {
    g.sent(bytes_per_rank(
        c,
        (width * elems as u64) as f64,
        g.size() as u64,
    ));
}

/// The planner's collective and the trace's name of `op`.
fn collective(op: TpOp) -> (Collective, &'static str) {
    match op {
        TpOp::AllReduce => (Collective::AllReduce, "all-reduce"),
        TpOp::AllGather => (Collective::AllGather, "all-gather"),
        TpOp::ReduceScatter => (Collective::ReduceScatter, "reduce-scatter"),
    }
}

/// Runs a collective in place in the group's planned buffer (`comm.tp.staging`): `fill`
/// writes its `len` inputs, `start` starts it; returns the result, to be read and handed back
/// to the buffer (`None`: it failed, recorded for [`Group::check`]).
fn staged(
    g: &Group,
    len: usize,
    fill: impl FnOnce(&mut [f32]),
    start: impl FnOnce(&dyn Communicator, Region<f32>) -> crate::Pending,
    op: &str,
) -> Option<Region<f32>> {
    let mut buf = std::mem::take(&mut *g.buffer());
    // Growing it here would allocate inside the step, outside the plan.
    assert!(
        buf.capacity() >= len,
        "internal: comm.tp.staging holds {} f32, a collective needs {len}",
        buf.capacity()
    );
    buf.set_len(0);
    buf.resize(len, 0.0);
    fill(&mut buf);
    match start(g.comm.as_ref(), buf).wait() {
        Ok(buf) => Some(buf),
        Err(e) => {
            g.fail(&format!("tensor-parallel {op}"), e);
            None
        }
    }
}

/// A tensor-parallel group as the engine calls it.
impl TpComm for Group {
    fn size(&self) -> usize {
        self.comm.size()
    }
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn run(&self, op: TpOp, len: usize, io: &mut dyn FnMut(&mut [f32], bool)) {
        // After a failure the pass runs on to its end without talking (the trainer reports
        // the failure then): the other ranks are gone or going.
        if self.failed() {
            return;
        }
        let (c, name) = collective(op);
        count(self, c, len, 4);
        let fill = |s: &mut [f32]| io(s, true);
        let start = |comm: &dyn Communicator, b| match op {
            TpOp::AllReduce => comm.all_reduce_start(b),
            TpOp::AllGather => comm.all_gather_start(b),
            TpOp::ReduceScatter => comm.reduce_scatter_start(b),
        };
        if let Some(mut out) = staged(self, len, fill, start, name) {
            io(&mut out, false);
            *self.buffer() = out;
        }
    }
    fn device(&self) -> Option<HostCopy> {
        self.device_copy()
    }
    fn on_device(&self, op: TpOp, x: DeviceOperands) -> bool {
        let on = self.device_collectives();
        let Some(dc) = on.as_ref().filter(|d| d.takes(x.dtype)) else {
            return false;
        };
        // After a failure, as `run`: the pass runs on without talking.
        if self.failed() {
            return true;
        }
        let (c, name) = collective(op);
        let elems = match op {
            TpOp::AllReduce => x.count,
            TpOp::AllGather | TpOp::ReduceScatter => x.count * self.size(),
        };
        count(self, c, elems, x.dtype.bytes());
        if let Err(e) = dc.run(op, x) {
            self.fail(&format!("tensor-parallel {name}"), e);
        }
        true
    }
}

/// The rank's part of `whole` (every parameter of the model, flat order) in the order of
/// `model`'s table: its tensor-parallel slice, its pipeline stage's tensors.
pub fn slice_of(model: &Llama, whole: &[f32]) -> Vec<f32> {
    let Some(part) = model.part() else {
        return whole.to_vec();
    };
    let mut out = vec![0.0; model.num_params()];
    for (l, f) in part.pieces {
        out[l.clone()].copy_from_slice(&whole[f.clone()]);
    }
    out
}

/// Whether the rank's parameters `r` are a replicated norm's (every rank of the group holds
/// the same gradient: the norm counts them once).
pub fn is_replicated(model: &Llama, r: &Range<usize>) -> bool {
    match &model.tp {
        Some(tp) => replicated(&tp.whole, &model.params, r.start),
        None => false,
    }
}
