//! What happens to a micro-batch's gradients as the backward completes them, and when its
//! backward is done: the one interface ([`GradSync`]) through which the step's micro-batch
//! loop (`trainer/step.rs`) reaches data parallelism, so the loop names no dimension.
//!
//! - [`Local`]: one replica; nothing to sum.
//! - [`Replicas`]: DDP and ZeRO-1 (PyTorch DDP, Li et al. 2020; ZeRO stage 1, Rajbhandari et
//!   al. 2020): the last micro-batch's gradients go into buckets as the backward finishes
//!   them, all-reduced (ZeRO-1: reduce-scattered into this rank's blocks) while the backward
//!   goes on.
//! - [`Sharded`]: ZeRO-2 and 3: every micro-batch's gradients are reduce-scattered into this
//!   rank's shard as they complete, since the backward's windows (`zero2`) are reused.
//!
//! [`SeqParallelNorms`] goes in front of any of them: sequence parallelism leaves each rank its
//! tokens' share of the norms' gradients, summed over the tensor-parallel group once final
//! (Korthikanti et al. 2022, §4.2.2).

use crate::data_parallel::{DataParallel, Sums};
use crate::group::Group;
use crate::zero::zero2::{GradWindows, UnitGrads};
use anyhow::Result;
use ferrotron_engine::kernels::{View, ViewMut};
use ferrotron_engine::model::tensor_parallel::all_reduce;
use ferrotron_engine::model::{GradBuf, GradsDone, Whole};
use ferrotron_engine::Elem;
use std::cell::RefCell;
use std::ops::Range;
use std::rc::Rc;

pub trait GradSync<G> {
    /// Whether a micro-batch's gradients are handed over as the backward completes them
    /// (`last`: the step's last micro-batch).
    fn syncs(&self, last: bool) -> bool;
    /// A micro-batch's forward begins (the buffers the backward accumulates into are ready).
    fn begin(&mut self, _grads: &mut dyn GradBuf<G>) {}
    /// A layer's (the head's, the embedding's) gradients are ready in `g`.
    fn ready(&mut self, done: GradsDone, g: &mut dyn GradBuf<G>);
    /// The micro-batch's backward is done: every sum lands (its error, if one failed).
    fn finish(&mut self, grads: &mut dyn GradBuf<G>) -> Result<()>;
}

/// One replica: the last micro-batch's reports reach the hooks in front (none otherwise).
pub struct Local;

impl<G> GradSync<G> for Local {
    fn syncs(&self, last: bool) -> bool {
        last
    }
    fn ready(&mut self, _: GradsDone, _: &mut dyn GradBuf<G>) {}
    fn finish(&mut self, _: &mut dyn GradBuf<G>) -> Result<()> {
        Ok(())
    }
}

/// DDP and ZeRO-1: the gradients summed in place over the replicas.
pub struct Replicas<'a>(pub &'a RefCell<DataParallel>);

impl<G: Elem> GradSync<G> for Replicas<'_> {
    fn syncs(&self, last: bool) -> bool {
        last
    }
    fn ready(&mut self, done: GradsDone, g: &mut dyn GradBuf<G>) {
        let mut sums = Sums {
            grads: g,
            shard: None,
        };
        let mut dp = self.0.borrow_mut();
        for r in dp.ranges(&done) {
            dp.add(&mut sums, r);
        }
    }
    fn finish(&mut self, grads: &mut dyn GradBuf<G>) -> Result<()> {
        self.0.borrow_mut().finish(&mut Sums { grads, shard: None })
    }
}

/// ZeRO-2 and 3: every micro-batch's gradients, from the backward's windows, added into this
/// rank's `shard` of the reduced gradients.
pub struct Sharded<'a, G> {
    pub dp: &'a RefCell<DataParallel>,
    pub shard: ViewMut<'a, G>,
    pub windows: &'a GradWindows,
}

impl<G: Elem> GradSync<G> for Sharded<'_, G> {
    fn syncs(&self, _last: bool) -> bool {
        true
    }
    fn begin(&mut self, grads: &mut dyn GradBuf<G>) {
        self.windows.clear(grads, self.dp.borrow().device_copy());
    }
    fn ready(&mut self, done: GradsDone, g: &mut dyn GradBuf<G>) {
        let mut sums = Sums {
            grads: g,
            shard: Some(self.shard.rb()),
        };
        let mut dp = self.dp.borrow_mut();
        for r in dp.ranges(&done) {
            dp.add(&mut sums, r);
        }
        // The layer window is copied into the buckets: ready for the next.
        if let GradsDone::Layer(..) = done {
            self.windows.clear_layer(sums.grads, dp.device_copy());
        }
    }
    fn finish(&mut self, grads: &mut dyn GradBuf<G>) -> Result<()> {
        self.dp.borrow_mut().finish(&mut Sums {
            grads,
            shard: Some(self.shard.rb()),
        })
    }
}

/// Sequence parallelism's norm sums (`tp`: the tensor-parallel group, when the model runs with
/// sequence parallelism), then `inner`.
pub struct SeqParallelNorms<S> {
    pub tp: Option<Rc<Group>>,
    pub inner: S,
}

impl<G: Elem, S: GradSync<G>> GradSync<G> for SeqParallelNorms<S> {
    fn syncs(&self, last: bool) -> bool {
        self.inner.syncs(last)
    }
    fn begin(&mut self, grads: &mut dyn GradBuf<G>) {
        self.inner.begin(grads)
    }
    fn ready(&mut self, done: GradsDone, g: &mut dyn GradBuf<G>) {
        if let Some(tp) = &self.tp {
            for r in norms_of(&done).into_iter().filter(|r| !r.is_empty()) {
                all_reduce(&**tp, g.slice_mut(r));
            }
        }
        self.inner.ready(done, g)
    }
    fn finish(&mut self, grads: &mut dyn GradBuf<G>) -> Result<()> {
        self.inner.finish(grads)
    }
}

/// The norms whose gradients a backward step has just completed (the parameters sequence
/// parallelism leaves partial on each rank), empty ranges where there is none: the step
/// allocates nothing for it.
pub(crate) fn norms_of(d: &GradsDone) -> [Range<usize>; 2] {
    match d {
        GradsDone::FinalNorm(r) => [(*r).clone(), 0..0],
        GradsDone::Layer(_, li) => [li.ln1.clone(), li.ln2.clone()],
        GradsDone::Embedding(_) => [0..0, 0..0],
    }
}

/// How a rank's gradient buffer is laid out, fixed when the trainer is built: every gradient
/// where the backward writes it, or under ZeRO-2 and 3 this rank's shard of `shard_len`
/// reduced gradients, then the windows the backward writes into. (No heap: cloned for a step.)
#[derive(Clone, Debug, Default)]
pub struct GradLayout {
    windows: Option<GradWindows>,
    shard_len: usize,
}

impl GradLayout {
    /// ZeRO-2 and 3's `windows` after a shard of `shard_len`; every gradient where the
    /// backward writes it without windows.
    pub fn new(windows: Option<GradWindows>, shard_len: usize) -> Self {
        GradLayout { windows, shard_len }
    }

    /// The windows the backward writes into, if the reduced gradients are sharded.
    pub fn windows(&self) -> Option<&GradWindows> {
        self.windows.as_ref()
    }

    /// A step's gradient buffer `grads`, split as laid out.
    pub fn split<'a, G: Elem>(&'a self, grads: ViewMut<'a, G>) -> StepGrads<'a, G> {
        StepGrads::new(grads, self.windows.as_ref(), self.shard_len)
    }
}

/// The gradient buffer as a step uses it: every gradient where the backward writes it, or
/// under ZeRO-2 and 3 this rank's shard of the reduced gradients, then the windows the
/// backward writes into.
pub enum StepGrads<'a, G> {
    Whole(Whole<'a, G>),
    Sharded {
        shard: ViewMut<'a, G>,
        units: UnitGrads<'a, G>,
        windows: &'a GradWindows,
    },
}

impl<'a, G: Elem> StepGrads<'a, G> {
    /// `grads` split as `windows` (ZeRO-2 and 3) ask, after a shard of `shard_len`.
    pub fn new(grads: ViewMut<'a, G>, windows: Option<&'a GradWindows>, shard_len: usize) -> Self {
        match windows {
            // ZeRO-2 and 3 run with data parallelism (on the host, or ZeRO-2 on a device).
            Some(w) => {
                let (shard, full) = grads.split_at_mut(shard_len);
                StepGrads::Sharded {
                    shard,
                    units: w.view(full),
                    windows: w,
                }
            }
            None => StepGrads::Whole(Whole(grads)),
        }
    }

    /// The buffer the backward writes, and the sync of its gradients over `dp` (with `tp`'s
    /// sequence-parallel norm sums in front).
    pub fn sync<'s>(
        &'s mut self,
        dp: Option<&'s RefCell<DataParallel>>,
        tp: Option<Rc<Group>>,
    ) -> (&'s mut dyn GradBuf<G>, SeqParallelNorms<DataSync<'s, G>>) {
        let (grads, inner): (&'s mut dyn GradBuf<G>, _) = match (self, dp) {
            (StepGrads::Whole(w), None) => (w, DataSync::Local(Local)),
            (StepGrads::Whole(w), Some(dp)) => (w, DataSync::Replicas(Replicas(dp))),
            (
                StepGrads::Sharded {
                    shard,
                    units,
                    windows,
                },
                Some(dp),
            ) => {
                let shard = shard.rb();
                (units, DataSync::Sharded(Sharded { dp, shard, windows }))
            }
            (StepGrads::Sharded { .. }, None) => unreachable!("ZeRO-2 and 3 shard over replicas"),
        };
        (grads, SeqParallelNorms { tp, inner })
    }

    /// The reduced gradients the optimizer reads: all of them (`shard` empty), or under
    /// ZeRO-2 and 3 this rank's shard (`grads` the windows).
    pub fn parts(&self) -> (&dyn GradBuf<G>, View<'_, G>) {
        match self {
            StepGrads::Whole(w) => (w, View::from(&[][..])),
            StepGrads::Sharded { shard, units, .. } => (units, shard.as_view()),
        }
    }

    /// The reduced gradient of the parameters `params`, which the optimizer keeps at `at` of
    /// its states: where the backward wrote it, or under ZeRO-2 and 3 in this rank's shard.
    pub fn reduced(&self, params: Range<usize>, at: usize) -> View<'_, G> {
        match self {
            StepGrads::Whole(w) => w.slice(params),
            StepGrads::Sharded { shard, .. } => shard.as_view().slice(at..at + params.len()),
        }
    }

    /// Writes `x` into the first reduced gradient this rank holds (the test-only NaN).
    pub fn poison(&mut self, x: G) {
        match self {
            StepGrads::Whole(w) => w.slice_mut(0..1).host_mut()[0] = x,
            StepGrads::Sharded { shard, .. } => shard.rb().slice_mut(0..1).host_mut()[0] = x,
        }
    }
}

/// The data-parallel sync of a step, as one of its kinds (on the stack: the step allocates
/// nothing for it).
pub enum DataSync<'a, G> {
    Local(Local),
    Replicas(Replicas<'a>),
    Sharded(Sharded<'a, G>),
}

impl<G: Elem> DataSync<'_, G> {
    fn get(&mut self) -> &mut dyn GradSync<G> {
        match self {
            DataSync::Local(s) => s,
            DataSync::Replicas(s) => s,
            DataSync::Sharded(s) => s,
        }
    }
}

impl<G: Elem> GradSync<G> for DataSync<'_, G> {
    fn syncs(&self, last: bool) -> bool {
        match self {
            DataSync::Local(s) => GradSync::<G>::syncs(s, last),
            DataSync::Replicas(s) => GradSync::<G>::syncs(s, last),
            DataSync::Sharded(s) => s.syncs(last),
        }
    }
    fn begin(&mut self, grads: &mut dyn GradBuf<G>) {
        self.get().begin(grads)
    }
    fn ready(&mut self, done: GradsDone, g: &mut dyn GradBuf<G>) {
        self.get().ready(done, g)
    }
    fn finish(&mut self, grads: &mut dyn GradBuf<G>) -> Result<()> {
        self.get().finish(grads)
    }
}
