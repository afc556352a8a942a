//! The trainer's side of tensor parallelism (the model's is `ferrotron_engine::model::
//! tensor_parallel`): the group's communicator behind the engine's [`TpComm`], which records a
//! failed collective (a dead rank) for the trainer to report after the pass, and counts the
//! bytes each rank sends as the planner prices them; the rank's slice of the whole model's
//! weights; and the gradient norm's share of the replicated norms.

use anyhow::anyhow;
type Result<T, E = anyhow::Error> = std::result::Result<T, E>;
use crate::small_sums::SmallSums;
use ferrotron_dist::Communicator;
use ferrotron_engine::model::tensor_parallel::replicated;
use ferrotron_engine::model::tensor_parallel::TpOp;
use ferrotron_engine::model::{Llama, TpComm};
use ferrotron_plan::comm::{bytes_per_rank, Collective};
use std::cell::{Cell, RefCell, RefMut};
use std::ops::Range;

/// A tensor-parallel group as the engine calls it.
pub struct TpGroup {
    comm: Box<dyn Communicator>,
    /// The plan's `comm.tp.staging`: every collective runs in place in it, so the backend
    /// allocates nothing (allocated with the first step, [`TpGroup::allocate`]).
    staging: RefCell<Vec<f32>>,
    /// The first collective that failed, reported by [`TpGroup::check`].
    failed: RefCell<Option<String>>,
    /// Bytes this rank sent since the counter was last taken.
    pub bytes: Cell<f64>,
}

impl TpGroup {
    pub fn new(comm: Box<dyn Communicator>) -> Self {
        TpGroup {
            comm,
            staging: RefCell::new(Vec::new()),
            failed: RefCell::new(None),
            bytes: Cell::new(0.0),
        }
    }

    fn record(&self, r: Result<(), ferrotron_dist::CommError>, op: &str) {
        if let Err(e) = r {
            self.failed
                .borrow_mut()
                .get_or_insert_with(|| format!("tensor-parallel {op}: {e}"));
        }
    }

    fn count(&self, c: Collective, elems: usize) {
        let bytes = bytes_per_rank(c, 4.0 * elems as f64, self.comm.size() as u64);
        self.bytes.set(self.bytes.get() + bytes);
    }

    /// Runs each kind of collective once on a tiny buffer, so what the backend sets up on
    /// first use (its worker, channels, the group's meeting point) is part of the process's
    /// baseline, before the plan's first buffer.
    pub fn warm_up(&self) -> Result<()> {
        let n = self.comm.size();
        let warm = |r: Result<Vec<f32>, ferrotron_dist::CommError>| {
            r.map(drop)
                .map_err(|e| anyhow!("tensor-parallel group warm-up: {e}"))
        };
        warm(self.comm.all_reduce_start(vec![0.0; n]).wait())?;
        warm(self.comm.all_gather_start(vec![0.0; n]).wait())
    }

    /// Allocates the staging buffer of the plan (`len` f32).
    pub fn allocate(&self, len: usize) {
        let mut s = self.staging.borrow_mut();
        if s.capacity() < len {
            *s = Vec::with_capacity(len);
        }
    }

    /// Runs a collective in place in the staging buffer: `fill` writes its `len` inputs,
    /// `start` starts it; returns the result, to be read and handed back with
    /// [`TpGroup::restore`] (`None`: it failed, recorded for [`TpGroup::check`]).
    fn staged(
        &self,
        len: usize,
        fill: impl FnOnce(&mut [f32]),
        start: impl FnOnce(&dyn Communicator, Vec<f32>) -> ferrotron_dist::Pending,
        op: &str,
    ) -> Option<Vec<f32>> {
        let mut buf = std::mem::take(&mut *self.staging.borrow_mut());
        // Growing it here would allocate inside the step, outside the plan.
        assert!(
            buf.capacity() >= len,
            "internal: comm.tp.staging holds {} f32, a collective needs {len}",
            buf.capacity()
        );
        buf.clear();
        buf.resize(len, 0.0);
        fill(&mut buf);
        match start(self.comm.as_ref(), buf).wait() {
            Ok(buf) => Some(buf),
            Err(e) => {
                self.record(Err(e), op);
                None
            }
        }
    }

    fn restore(&self, buf: Vec<f32>) {
        *self.staging.borrow_mut() = buf;
    }

    /// The error of a collective that failed during the pass, if one did.
    pub fn check(&self) -> Result<()> {
        match self.failed.borrow_mut().take() {
            Some(e) => Err(anyhow!(e)),
            None => Ok(()),
        }
    }

    pub fn size(&self) -> usize {
        self.comm.size()
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
}

impl TpComm for TpGroup {
    fn size(&self) -> usize {
        self.comm.size()
    }
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn run(&self, op: TpOp, len: usize, io: &mut dyn FnMut(&mut [f32], bool)) {
        // After a failure the pass runs on to its end without talking (the trainer reports
        // the failure then): the other ranks are gone or going.
        if self.failed.borrow().is_some() {
            return;
        }
        let (c, name) = match op {
            TpOp::AllReduce => (Collective::AllReduce, "all-reduce"),
            TpOp::AllGather => (Collective::AllGather, "all-gather"),
            TpOp::ReduceScatter => (Collective::ReduceScatter, "reduce-scatter"),
        };
        self.count(c, len);
        let fill = |s: &mut [f32]| io(s, true);
        let start = |comm: &dyn Communicator, b| match op {
            TpOp::AllReduce => comm.all_reduce_start(b),
            TpOp::AllGather => comm.all_gather_start(b),
            TpOp::ReduceScatter => comm.reduce_scatter_start(b),
        };
        if let Some(mut out) = self.staged(len, fill, start, name) {
            io(&mut out, false);
            self.restore(out);
        }
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

/// Small sums (the gradient norm's) gather in the planned staging buffer.
impl SmallSums for TpGroup {
    fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }
    fn small(&self) -> RefMut<'_, Vec<f32>> {
        self.staging.borrow_mut()
    }
}
