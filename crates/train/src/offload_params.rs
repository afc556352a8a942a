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
//! Gradient accumulation stays bit for bit the plain run's: before a unit's backward adds a
//! micro-batch's gradients to its window, the window is loaded with the host's running sum,
//! so the backward's kernels add to the same values in the same order. (Adding a window of
//! fresh gradients to the host's sum instead would round 16-bit gradients twice.)

use crate::optim::host_tier::HostBuf;
use crate::optim::offload::{copy_down, copy_up, typed};
use crate::weights::Flat;
use anyhow::Result;
use ferrotron_dist::grad_sync::GradSync;
use ferrotron_dist::zero::zero2::{GradWindows, UnitGrads};
use ferrotron_dist::zero::zero3::{Source, Zero3};
use ferrotron_engine::kernels::{DeviceAlloc, ViewMut};
use ferrotron_engine::model::{GradBuf, GradsDone, ParamTable};
use ferrotron_engine::Elem;
use ferrotron_plan::DType;
use std::ops::Range;
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
    dtype: DType,
    geo: GradWindows,
    sched: Zero3,
    dev: Arc<dyn DeviceAlloc>,
}

/// `v`'s bytes in f32 words (the last one zero-padded).
fn words<T: Elem>(v: &[T]) -> HostBuf<f32> {
    let mut b = HostBuf::<f32>::zeros(size_of_val(v).div_ceil(4));
    typed::<T>(&mut b, v.len()).host_mut().copy_from_slice(v);
    b
}

impl Streaming {
    /// `params`, the weights as initialised or loaded, moved into host memory, and zero
    /// gradients of `grads` type; `dev` is the device the windows live on.
    pub fn new(params: &Flat, grads: DType, t: &ParamTable, dev: Arc<dyn DeviceAlloc>) -> Self {
        let n = params.len();
        let params_words = match params {
            Flat::F32(v) => words(v),
            Flat::Bf16(v) => words(v),
            Flat::F16(v) => words(v),
        };
        Streaming {
            params: params_words,
            grads: HostBuf::zeros((n * grads.bytes() as usize).div_ceil(4)),
            n,
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

    /// The weights as a host `Flat` (for a checkpoint or a sample).
    pub fn to_flat(&mut self) -> Flat {
        let n = self.n;
        match self.dtype {
            DType::F32 => Flat::F32(typed(&mut self.params, n).into_view().host().to_vec()),
            DType::Bf16 => Flat::Bf16(typed(&mut self.params, n).into_view().host().to_vec()),
            DType::F16 => Flat::F16(typed(&mut self.params, n).into_view().host().to_vec()),
            d => unreachable!("no weights are stored as {d:?}"),
        }
    }

    /// The model's parameters for a step or an evaluation: the device's `windows`, filled
    /// from the host by the schedule.
    pub fn source<'a, S: Elem>(&'a mut self, windows: ViewMut<'a, S>) -> Source<'a, S> {
        let host = typed::<S>(&mut self.params, self.n).into_view();
        Source::streamed(windows, host, &mut self.sched, &*self.dev)
    }

    /// A step's forward and backward: the parameters' source over the device's `windows`,
    /// the device's gradient windows `grads` as the backward addresses them, and their sync
    /// into the host's gradients, zeroed.
    pub fn micro_batches<'a, S: Elem, G: Elem>(
        &'a mut self,
        windows: ViewMut<'a, S>,
        grads: ViewMut<'a, G>,
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
        };
        (src, self.geo.view(grads), sync)
    }

    /// The step's update: the host's weights and the gradients the micro-batches summed.
    pub fn update<S: Elem, G: Elem>(&mut self) -> (ViewMut<'_, S>, ViewMut<'_, G>) {
        let n = self.n;
        (typed(&mut self.params, n), typed(&mut self.grads, n))
    }
}

/// The backward's gradient windows on the device, against the host's gradients (see the
/// module docs): each unit's window is loaded with the host's sum before its backward and
/// copied back once the backward completes it.
pub struct HostGrads<'a, G> {
    host: ViewMut<'a, G>,
    geo: &'a GradWindows,
    dev: &'a dyn DeviceAlloc,
    layers: usize,
}

impl<G: Elem> HostGrads<'_, G> {
    fn layer(&self, i: usize) -> Range<usize> {
        let start = self.geo.layers.start + i * self.geo.layer_len;
        start..start + self.geo.layer_len
    }

    /// The host's gradients `r` into their window.
    fn load(&mut self, g: &mut dyn GradBuf<G>, r: Range<usize>) {
        let mut w = g.slice_mut(r.clone());
        // SAFETY: `w` is `r.len()` elements of the device's memory.
        unsafe { copy_up(self.dev, self.host.as_view().slice(r), w.as_mut_ptr()) };
    }

    /// Window `r` into the host's gradients.
    fn store(&mut self, g: &mut dyn GradBuf<G>, r: Range<usize>) {
        let w = g.slice(r.clone());
        // SAFETY: `w` is `r.len()` elements of the device's memory.
        unsafe { copy_down(self.dev, w.as_ptr(), self.host.rb().slice_mut(r)) };
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
        match done {
            // The final norm, and an untied LM head (complete since the head's forward).
            GradsDone::FinalNorm(_) => {
                let head = self.geo.head.clone();
                self.store(g, head);
            }
            GradsDone::Layer(i, _) => {
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
    }

    fn finish(&mut self, _: &mut dyn GradBuf<G>) -> Result<()> {
        Ok(())
    }
}
