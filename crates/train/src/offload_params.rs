//! `--offload params` (ZeRO-Infinity's parameter offload, Rajbhandari et al. 2021 §5.1): the
//! weights and their gradients live in host memory, and the device holds only the units in
//! flight, in the windows ZeRO-3 uses (`ferrotron_dist::zero`: `zero3.rs`, `zero2.rs`):
//! - parameter windows (the embedding's, the head's, two layers'): each unit is uploaded from
//!   the host as the model asks for it, and the next layer one layer ahead, by ZeRO-3's
//!   schedule (`ferrotron_plan::zero3`);
//! - gradient windows (the embedding's, the head's, one layer's): [`HostGrads`] moves each
//!   unit's gradients to the host as the backward completes it.
//!
//! The optimizer (`--offload optimizer`'s tier, `optim::offload`) then updates the host's
//! weights from the host's gradients with the CPU kernels.
//!
//! With ZeRO-3 over data parallelism (ZeRO-Infinity's sharded offload, Rajbhandari et al.
//! 2021 §5: "partitioned parameters ... offloaded to CPU", each rank 1/dp of them), the host
//! holds only this rank's shard of the weights and gradients (`Streaming::new`'s `shard`): the
//! windows are filled by ZeRO-3's all-gather from every rank's host shard (`Zero3::source`,
//! one layer ahead as above) and each unit's gradients are reduce-scattered from the device's
//! window into the host's shard (`grad_sync`'s ZeRO-2/3 sync), exactly as `--zero 3` does
//! with its shard on the device; the step is `trainer/stream_step.rs`'s.
//!
//! Gradient accumulation stays bit for bit the plain run's: before a unit's backward adds a
//! micro-batch's gradients to its window, the window is loaded with the host's running sum,
//! so the backward's kernels add to the same values in the same order. (Adding a window of
//! fresh gradients to the host's sum instead would round 16-bit gradients twice.)

use crate::optim::host_tier::HostBuf;
use crate::optim::offload::{copy_down, copy_up, typed};
use crate::weights::Flat;
use anyhow::Result;
use ferrotron_dist::data_parallel::{DataParallel, Sums};
use ferrotron_dist::grad_sync::GradSync;
use ferrotron_dist::zero::zero2::{GradWindows, UnitGrads};
use ferrotron_dist::zero::zero3::{Source, Zero3};
use ferrotron_engine::kernels::{DeviceAlloc, ViewMut};
use ferrotron_engine::model::{GradBuf, GradsDone, ParamTable, Whole};
use ferrotron_engine::Elem;
use ferrotron_plan::planner::RankPlan;
use ferrotron_plan::DType;
use std::cell::RefCell;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

/// The host's weights and gradients of a rank that streams its parameters, and the windows'
/// geometry and schedule.
pub struct Streaming {
    /// Every weight (storage type) and every gradient (the engine's gradient type), as f32
    /// words allocated outside the tracking allocator (`HostBuf`): on the emulated device
    /// that allocator measures the device.
    params: HostBuf<f32>,
    grads: HostBuf<f32>,
    n: usize,
    /// Sharded (ZeRO-3): elements of ZeRO-3's windows that follow the shard in the trainer's
    /// weights (`to_flat` gives them back in that layout); `None`: the whole model.
    pad: Option<usize>,
    dtype: DType,
    geo: GradWindows,
    sched: Zero3,
    dev: Arc<dyn DeviceAlloc>,
}

/// `v`'s bytes in f32 words (the last one zero-padded), in `dev`'s page-locked memory where
/// it has some.
fn words<T: Elem>(v: &[T], dev: &Arc<dyn DeviceAlloc>) -> HostBuf<f32> {
    let mut b = HostBuf::<f32>::pinned(size_of_val(v).div_ceil(4), dev);
    typed::<T>(&mut b, v.len()).host_mut().copy_from_slice(v);
    b
}

impl Streaming {
    /// `params`, the weights as initialised or loaded, moved into host memory, and zero
    /// gradients of `grads` type; `dev` is the device the windows live on. Under ZeRO-3,
    /// `shard` is this rank's elements: the first `shard` of `params` (ZeRO-3's windows follow
    /// them there) are all the host keeps. Both are page-locked where the device has such
    /// memory: every micro-batch copies them across, at the link's full bandwidth.
    pub fn new(
        params: &Flat,
        grads: DType,
        t: &ParamTable,
        dev: Arc<dyn DeviceAlloc>,
        shard: Option<usize>,
    ) -> Self {
        let n = shard.unwrap_or(params.len());
        let params_words = match params {
            Flat::F32(v) => words(&v[..n], &dev),
            Flat::Bf16(v) => words(&v[..n], &dev),
            Flat::F16(v) => words(&v[..n], &dev),
        };
        Streaming {
            params: params_words,
            grads: HostBuf::pinned((n * grads.bytes() as usize).div_ceil(4), &dev),
            n,
            pad: shard.map(|n| params.len() - n),
            dtype: params.dtype(),
            geo: GradWindows::new(t),
            sched: Zero3::new(t),
            dev,
        }
    }

    /// Elements of the device's parameter windows (the plan's `offload.param_windows`).
    pub fn param_windows(&self) -> usize {
        self.sched.len()
    }

    /// Elements of the device's gradient windows (the plan's `zero2.grad_windows`).
    pub fn grad_windows(&self) -> usize {
        self.geo.len()
    }

    /// The windows the engine's units fill are the plan's `offload.param_windows` and
    /// `comm.zero2.grad_windows` (a mismatch is a bug: the device's measured peak would leave
    /// its plan).
    pub fn check_plan(&self, plan: &RankPlan) -> Result<()> {
        let name = self.windows_name();
        let params = plan.plan.find(name).map_or(0, |b| b.numel);
        let held = (self.param_windows(), self.grad_windows());
        check_window_sizes(name, held, (params, plan.states.grad_windows))
    }

    /// Whether the host holds only this rank's ZeRO-3 shard.
    pub fn sharded(&self) -> bool {
        self.pad.is_some()
    }

    /// The plan's name of the parameter windows: ZeRO-3's own when sharded.
    fn windows_name(&self) -> &'static str {
        match self.sharded() {
            true => "zero3.param_windows",
            false => PARAM_WINDOWS,
        }
    }

    /// The weights as a host `Flat` (for a checkpoint or a sample), in the trainer's layout
    /// (sharded: the shard, then zeros where ZeRO-3's windows are).
    pub fn to_flat(&mut self) -> Flat {
        let n = self.n;
        let pad = self.pad.unwrap_or(0);
        fn padded<T: Elem>(v: &[T], pad: usize) -> Vec<T> {
            let mut out = Vec::with_capacity(v.len() + pad);
            out.extend_from_slice(v);
            out.resize(v.len() + pad, T::from_f32(0.0));
            out
        }
        match self.dtype {
            DType::F32 => {
                Flat::F32(padded(typed(&mut self.params, n).into_view().host(), pad).into())
            }
            DType::Bf16 => {
                Flat::Bf16(padded(typed(&mut self.params, n).into_view().host(), pad).into())
            }
            DType::F16 => {
                Flat::F16(padded(typed(&mut self.params, n).into_view().host(), pad).into())
            }
            d => unreachable!("no weights are stored as {d:?}"),
        }
    }

    /// The model's parameters for an evaluation: the device's `windows`, filled from the
    /// host by the schedule (sharded: gathered by ZeRO-3's `zero3` over `dp`).
    pub fn source<'a, S: Elem>(
        &'a mut self,
        windows: ViewMut<'a, S>,
        zero3: Option<&'a mut Zero3>,
        dp: Option<&'a RefCell<DataParallel>>,
    ) -> Source<'a, S> {
        let host = typed::<S>(&mut self.params, self.n).into_view();
        match (zero3, dp, self.pad) {
            (Some(z), Some(dp), Some(_)) => {
                z.invalidate();
                Source::Gathered(z.source(dp, host, windows))
            }
            _ => Source::streamed(windows, host, &mut self.sched, &*self.dev),
        }
    }

    /// A step of `micro_batches` forwards and backwards: the parameters' source over the
    /// device's `windows`, the device's gradient windows `grads` as the backward addresses
    /// them, and their sync into the host's gradients, zeroed (and with data parallelism `dp`,
    /// summed over the replicas in the last backward).
    pub fn micro_batches<'a, S: Elem, G: Elem>(
        &'a mut self,
        windows: ViewMut<'a, S>,
        grads: ViewMut<'a, G>,
        micro_batches: usize,
        dp: Option<&'a RefCell<DataParallel>>,
    ) -> (Source<'a, S>, UnitGrads<'a, G>, HostGrads<'a, G>) {
        let n = self.n;
        let layers = self.sched.layers();
        let mut host = typed::<G>(&mut self.grads, n);
        host.rb().host_mut().fill(G::from_f32(0.0));
        let params = typed::<S>(&mut self.params, n).into_view();
        let src = Source::streamed(windows, params, &mut self.sched, &*self.dev);
        let sync = HostGrads {
            host,
            geo: &self.geo,
            dev: &*self.dev,
            layers,
            mb: 0,
            micro_batches,
            dp,
        };
        (src, self.geo.view(grads), sync)
    }

    /// The step's update: the host's weights and the gradients the micro-batches summed.
    pub fn update<S: Elem, G: Elem>(&mut self) -> (ViewMut<'_, S>, ViewMut<'_, G>) {
        let n = self.n;
        (typed(&mut self.params, n), typed(&mut self.grads, n))
    }
}

/// The plan's name of the parameter windows.
const PARAM_WINDOWS: &str = "offload.param_windows";

/// The parameter and gradient windows' elements `held` against the plan's (`name`: the
/// parameter windows').
fn check_window_sizes(name: &str, held: (usize, usize), planned: (u64, u64)) -> Result<()> {
    crate::setup::check_sizes(&[
        (name, Some(held.0), planned.0),
        ("comm.zero2.grad_windows", Some(held.1), planned.1),
    ])
}

/// The backward's gradient windows on the device, against the host's gradients (see the
/// module docs): each unit's window is loaded with the host's sum before its backward and
/// copied back once the backward completes it.
pub struct HostGrads<'a, G> {
    host: ViewMut<'a, G>,
    geo: &'a GradWindows,
    dev: &'a dyn DeviceAlloc,
    layers: usize,
    /// The micro-batch running, of the step's `micro_batches`. The first one's windows start
    /// from zero, with nothing to upload (the planner counts the sums' upload from the second
    /// on, `ferrotron_plan`'s `time/param_stream.rs`).
    mb: usize,
    micro_batches: usize,
    /// Data parallelism (ZeRO-0: every rank holds the whole weights and gradients on the
    /// host): in the last backward each unit's host gradients, once stored, go into the
    /// plan's f32 buckets, whose all-reduce runs while the backward goes on and writes the
    /// sums back to the host (DDP's bucketed reduction, `data_parallel.rs`, here on host
    /// memory). The sums are the plain run's: the same gradients, added in f32 and rounded
    /// once.
    dp: Option<&'a RefCell<DataParallel>>,
}

impl<G: Elem> HostGrads<'_, G> {
    fn layer(&self, i: usize) -> Range<usize> {
        let start = self.geo.layers.start + i * self.geo.layer_len;
        start..start + self.geo.layer_len
    }

    /// The host's gradients `r` into their window (zeros in the first micro-batch).
    fn load(&mut self, g: &mut dyn GradBuf<G>, r: Range<usize>) {
        let mut w = g.slice_mut(r.clone());
        let p = NonNull::new(w.as_mut_ptr().cast::<u8>()).expect("never null");
        // SAFETY: `w` is `r.len()` elements of the device's memory.
        unsafe {
            match self.mb == 0 {
                true => self.dev.zero(p, r.len() * size_of::<G>()),
                false => copy_up(self.dev, self.host.as_view().slice(r), w.as_mut_ptr()),
            }
        }
    }

    /// Window `r` into the host's gradients.
    fn store(&mut self, g: &mut dyn GradBuf<G>, r: Range<usize>) {
        let w = g.slice(r.clone());
        // SAFETY: `w` is `r.len()` elements of the device's memory.
        unsafe { copy_down(self.dev, w.as_ptr(), self.host.rb().slice_mut(r)) };
    }

    /// In the last backward, with data parallelism: the host's gradients of `done` into the
    /// replicas' sum.
    fn reduce(&mut self, done: &GradsDone) {
        let Some(dp) = self.dp.filter(|_| self.mb + 1 == self.micro_batches) else {
            return;
        };
        let mut dp = dp.borrow_mut();
        let mut host = Whole(self.host.rb());
        let mut sums = Sums {
            grads: &mut host,
            shard: None,
        };
        let ranges: Vec<_> = dp.ranges(done).collect();
        for r in ranges {
            dp.add(&mut sums, r);
        }
    }
}

impl<G: Elem> GradSync<G> for HostGrads<'_, G> {
    /// Every micro-batch: the windows are reused by the next.
    fn syncs(&self, _last: bool) -> bool {
        true
    }

    /// The head's forward adds the LM head's gradient (tied: in the embedding's window), and
    /// the backward starts with the last layer.
    fn begin(&mut self, g: &mut dyn GradBuf<G>) {
        let (embed, head) = (self.geo.embed.clone(), self.geo.head.clone());
        self.load(g, embed);
        self.load(g, head);
        if self.layers > 0 {
            let last = self.layer(self.layers - 1);
            self.load(g, last);
        }
    }

    fn ready(&mut self, done: GradsDone, g: &mut dyn GradBuf<G>) {
        match &done {
            // The final norm, and an untied LM head (complete since the head's forward).
            GradsDone::FinalNorm(_) => {
                let head = self.geo.head.clone();
                self.store(g, head);
            }
            &GradsDone::Layer(i, _) => {
                let r = self.layer(i);
                self.store(g, r);
                if i > 0 {
                    let next = self.layer(i - 1);
                    self.load(g, next);
                }
            }
            GradsDone::Embedding(_) => {
                let embed = self.geo.embed.clone();
                self.store(g, embed);
            }
        }
        self.reduce(&done);
    }

    fn finish(&mut self, _: &mut dyn GradBuf<G>) -> Result<()> {
        let last = self.mb + 1 == self.micro_batches;
        self.mb += 1;
        match self.dp.filter(|_| last) {
            Some(dp) => {
                let mut host = Whole(self.host.rb());
                let mut sums = Sums {
                    grads: &mut host,
                    shard: None,
                };
                dp.borrow_mut().finish(&mut sums)
            }
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_other_than_the_plans_are_refused_naming_the_buffer() {
        assert!(check_window_sizes(PARAM_WINDOWS, (10, 7), (10, 7)).is_ok());
        let e = check_window_sizes(PARAM_WINDOWS, (12, 7), (10, 7))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "internal: the engine's units fill 12 elements of `offload.param_windows`, the plan's are 10"
        );
        let e = check_window_sizes(PARAM_WINDOWS, (10, 7), (10, 9))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "internal: the engine's units fill 7 elements of `comm.zero2.grad_windows`, the plan's are 9"
        );
    }
}
