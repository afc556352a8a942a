//! ZeRO-3's parameter windows (Rajbhandari et al. 2020, §5.3, P_os+g+p): a rank keeps only
//! its shard of the parameters (block `rank` of every unit, `data_parallel::Buckets::Units`)
//! and all-gathers a unit's parameters into a window just before the model reads them, by the
//! schedule of `ferrotron_plan::zero3` (the planner counts the same windows and bytes):
//! - the embedding's and the head's windows, gathered at their first use in a step;
//! - two layer windows: the layer the model computes, and the next one the schedule asks for,
//!   whose all-gather runs while the current layer computes (prefetch).
//!
//! The model asks for each unit through [`Gathered`], its `ParamSource`; every request is
//! checked against the schedule, and a read outside the unit asked for panics (a bug, not an
//! input). Gradients go through ZeRO-2's windows (`zero2`), reduce-scattered unit by unit.

use super::zero2::GradWindows;
use crate::data_parallel::DataParallel;
use anyhow::{bail, Result};
use ferrotron_engine::kernels::host_copy::{copy_up_ahead, read_f32, write_f32, HostCopy};
use ferrotron_engine::kernels::{DeviceAlloc, View, ViewMut};
use ferrotron_engine::model::{ParamBuf, ParamSource, ParamTable, Unit, WholeParams};
use ferrotron_engine::Elem;
use ferrotron_plan::zero3::{eval_sequence, next_layer, train_sequence, LayerWindows};
use std::cell::RefCell;
use std::ops::Range;

/// ZeRO-3's state on one rank: the windows' geometry, what they hold, and where in the
/// schedule the model is.
pub struct Zero3 {
    /// The units' ranges (shared with ZeRO-2's gradient windows).
    geo: GradWindows,
    layers: usize,
    train: Vec<Unit>,
    eval: Vec<Unit>,
    /// The schedule being followed (evaluation or training) and the next request in it.
    evaluating: bool,
    at: usize,
    held: LayerWindows,
    /// Whether the embedding's and the head's windows hold this step's parameters.
    ends: [bool; 2],
    /// The all-gather running, for which unit and layer window.
    pending: Option<(Unit, usize)>,
    /// The first failure (a collective, a request off the schedule), reported by the trainer
    /// after the forward or backward.
    error: Option<String>,
}

impl Zero3 {
    pub fn new(t: &ParamTable) -> Self {
        let layers = t.layers.len();
        Zero3 {
            geo: GradWindows::new(t),
            layers,
            train: train_sequence(layers),
            eval: eval_sequence(layers),
            evaluating: false,
            at: 0,
            held: LayerWindows::default(),
            ends: [false; 2],
            pending: None,
            error: None,
        }
    }

    /// Decoder layers of the model.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Elements of the windows: the embedding's, the head's, two layers' (the plan's
    /// `zero3.param_windows`).
    pub fn len(&self) -> usize {
        self.geo.embed.len() + self.geo.head.len() + 2 * self.geo.layer_len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The parameters changed (an optimizer step): no window holds valid ones.
    pub fn invalidate(&mut self) {
        self.held.clear();
        self.ends = [false; 2];
    }

    /// A training micro-batch (or, with `eval`, a forward without gradients) begins: the model
    /// asks for the units of its schedule from the first.
    pub fn begin(&mut self, eval: bool) {
        (self.evaluating, self.at) = (eval, 0);
    }

    /// The first failure since the last call.
    pub fn take_error(&mut self) -> Option<String> {
        self.error.take()
    }

    /// The bucket of unit `u` in `data_parallel::unit_groups` order: the head, the layers
    /// last to first, the embedding.
    fn bucket(&self, u: Unit) -> usize {
        match u {
            Unit::Head => 0,
            Unit::Layer(i) => self.layers - i,
            Unit::Embedding => self.layers + 1,
        }
    }

    /// Where parameters `r` of unit `u` sit in the windows (layers: in window `slot`).
    fn place(&self, u: Unit, slot: usize, r: &Range<usize>) -> Range<usize> {
        let g = &self.geo;
        let at = match u {
            Unit::Embedding => r.start - g.embed.start,
            Unit::Head => g.embed.len() + r.start - g.head.start,
            Unit::Layer(_) => {
                let within = (r.start - g.layers.start) % g.layer_len;
                g.embed.len() + g.head.len() + slot * g.layer_len + within
            }
        };
        at..at + r.len()
    }

    /// Every parameter of unit `u` in the flat order.
    fn range(&self, u: Unit) -> Range<usize> {
        let g = &self.geo;
        match u {
            Unit::Embedding => g.embed.clone(),
            Unit::Head => g.head.clone(),
            Unit::Layer(i) => {
                let start = g.layers.start + i * g.layer_len;
                start..start + g.layer_len
            }
        }
    }

    /// The unit whose window holds parameters `r`, with the layer asked for (and its window)
    /// being the only layer readable.
    fn unit_of(&self, r: &Range<usize>, layer: Option<(usize, usize)>) -> Option<(Unit, usize)> {
        let g = &self.geo;
        let inside = |u: &Range<usize>| r.start >= u.start && r.end <= u.end;
        if inside(&g.embed) {
            return Some((Unit::Embedding, 0));
        }
        if inside(&g.head) {
            return Some((Unit::Head, 0));
        }
        let (i, slot) = layer?;
        let start = g.layers.start + i * g.layer_len;
        inside(&(start..start + g.layer_len)).then_some((Unit::Layer(i), slot))
    }

    /// The model's view of the windows for this step: `shard` is this rank's parameters,
    /// `windows` the [`Zero3::len`] elements after them (on the host, or on the device whose
    /// copies data parallelism holds).
    pub fn source<'a, S>(
        &'a mut self,
        dp: &'a RefCell<DataParallel>,
        shard: View<'a, S>,
        windows: ViewMut<'a, S>,
    ) -> Gathered<'a, S> {
        let dev = dp.borrow().device_copy().cloned();
        Gathered {
            z: self,
            fill: Fill::Gather { dp, shard, dev },
            windows,
            layer: None,
        }
    }

    /// `--offload params`: the model's view of the windows (`windows`, [`Zero3::len`]
    /// elements on `dev`), each unit uploaded from `host`, the host's copy of every weight.
    pub fn streamed<'a, S>(
        &'a mut self,
        host: View<'a, S>,
        windows: ViewMut<'a, S>,
        dev: &'a dyn DeviceAlloc,
    ) -> Gathered<'a, S> {
        Gathered {
            z: self,
            fill: Fill::Upload { host, dev },
            windows,
            layer: None,
        }
    }
}

/// Where a unit's parameters come from.
enum Fill<'a, S> {
    /// ZeRO-3: every rank's block of it, all-gathered over data parallelism; `shard` is this
    /// rank's, `dev` the copies to and from the device it lives on (`None`: the host).
    Gather {
        dp: &'a RefCell<DataParallel>,
        shard: View<'a, S>,
        dev: Option<HostCopy>,
    },
    /// `--offload params`: the host's copy of every weight, uploaded to the device `dev`
    /// (ZeRO-Infinity's parameter offload, Rajbhandari et al. 2021 §5.1).
    Upload {
        host: View<'a, S>,
        dev: &'a dyn DeviceAlloc,
    },
}

/// The parameters as the model reads them under ZeRO-3 (see the module docs).
pub struct Gathered<'a, S> {
    z: &'a mut Zero3,
    fill: Fill<'a, S>,
    windows: ViewMut<'a, S>,
    /// The layer asked for last, and its window.
    layer: Option<(usize, usize)>,
}

impl<S: Elem> Gathered<'_, S> {
    /// Starts filling unit `u`'s window (layers: window `slot`), after the running all-gather
    /// has landed. An upload runs on the device's copy stream, after the kernels already
    /// issued (which may still read the window's last unit) and beside those issued next,
    /// until [`Self::land`] orders the compute stream after it.
    fn start(&mut self, u: Unit, slot: usize) {
        self.land();
        match &self.fill {
            Fill::Gather { dp, shard, .. } if dp.borrow().gathers_in_place() => {
                let (z, windows) = (&*self.z, self.windows.rb());
                let place = |r: &Range<usize>| z.place(u, slot, r);
                let started =
                    (dp.borrow_mut()).gather_unit_in_place(z.range(u), *shard, windows, &place);
                if let Err(e) = started {
                    self.z.error.get_or_insert(e.to_string());
                }
                self.z.pending = Some((u, slot));
            }
            Fill::Gather { dp, shard, dev } => {
                let (k, shard, dev) = (self.z.bucket(u), *shard, dev.as_ref());
                let own = &mut |seg: &crate::data_parallel::Segment, out: &mut [f32]| {
                    read_f32(dev, shard.slice(seg.at..seg.at + seg.params.len()), out);
                };
                dp.borrow_mut().gather_start(k, own);
                self.z.pending = Some((u, slot));
            }
            Fill::Upload { host, dev } => {
                let r = self.z.range(u);
                let mut dst = self.windows.rb().slice_mut(self.z.place(u, slot, &r));
                // SAFETY: `dst` is `r.len()` elements of `dev`'s memory; the host's weights
                // change only in the update, after this source is dropped (which settles).
                unsafe { copy_up_ahead(*dev, host.slice(r), dst.as_mut_ptr()) };
            }
        }
    }

    /// Waits for the running all-gather and writes it into its window; or orders the
    /// compute stream's next work after the uploads started so far (the host does not wait).
    fn land(&mut self) {
        if let Fill::Upload { dev, .. } = &self.fill {
            dev.await_uploads();
            return;
        }
        let Some((u, slot)) = self.z.pending.take() else {
            return;
        };
        let Fill::Gather { dp, dev, .. } = &self.fill else {
            unreachable!("only an all-gather is pending")
        };
        let mut dp = dp.borrow_mut();
        // On the device (NCCL) the gathers wrote the window: the compute stream waits for them.
        if dp.gathers_in_place() {
            if let Err(e) = dp.land_in_place() {
                self.z.error.get_or_insert(e.to_string());
            }
            return;
        }
        match dp.gather_wait() {
            Ok((pieces, values)) => {
                for (r, at) in pieces {
                    let dst = self.windows.rb().slice_mut(self.z.place(u, slot, r));
                    write_f32(dev.as_ref(), &values[*at..at + r.len()], dst);
                }
            }
            Err(e) => {
                self.z.error.get_or_insert(e.to_string());
            }
        }
    }
}

impl<S: Elem> ParamBuf<S> for Gathered<'_, S> {
    fn slice(&self, r: Range<usize>) -> View<'_, S> {
        match self.z.unit_of(&r, self.layer) {
            Some((u, slot)) => self.windows.as_view().slice(self.z.place(u, slot, &r)),
            None => panic!(
                "parameters {r:?} read outside the ZeRO-3 windows (layer {:?} asked for)",
                self.layer
            ),
        }
    }
}

impl<S: Elem> ParamSource<S> for Gathered<'_, S> {
    fn unit(&mut self, u: Unit) -> &dyn ParamBuf<S> {
        let z = &mut *self.z;
        let seq = if z.evaluating { &z.eval } else { &z.train };
        if seq.get(z.at) != Some(&u) {
            let e = format!(
                "internal: the model asked for {u:?} where the ZeRO-3 schedule has {:?}",
                seq.get(z.at)
            );
            z.error.get_or_insert(e);
        }
        let layer = match u {
            Unit::Layer(i) => Some(i),
            _ => None,
        };
        let next = (z.at < seq.len())
            .then(|| next_layer(seq, z.at, layer))
            .flatten();
        z.at += 1;
        let fetch = z.held.request(layer, next);
        match u {
            Unit::Embedding | Unit::Head => {
                let end = usize::from(u == Unit::Head);
                if !self.z.ends[end] {
                    self.start(u, 0);
                    self.land();
                    self.z.ends[end] = true;
                }
            }
            Unit::Layer(_) => {
                // An upload started one layer ahead is awaited here, before the next starts
                // (which the layer's kernels then need not wait for).
                let uploaded = matches!(self.fill, Fill::Upload { .. });
                let landing = uploaded || self.z.pending.is_some_and(|p| p.0 == u);
                if fetch.gather {
                    self.start(u, fetch.slot);
                }
                if fetch.gather || landing {
                    self.land();
                }
            }
        }
        self.layer = layer.map(|i| (i, fetch.slot));
        if let Some((slot, j)) = fetch.prefetch {
            self.start(Unit::Layer(j), slot);
        }
        // MPI advances a started all-gather only inside MPI calls: look in on the running one
        // at every request (the forward makes no other call).
        if let Fill::Gather { dp, .. } = &self.fill {
            dp.borrow().poll();
        }
        self
    }
}

/// The host's weights may change once the uploads are dropped (the update): every upload
/// started has then run, one ahead included.
impl<S> Drop for Gathered<'_, S> {
    fn drop(&mut self) {
        if let Fill::Upload { dev, .. } = &self.fill {
            dev.settle_uploads();
        }
    }
}

/// Where a step or an evaluation reads parameters: every weight in one buffer, or ZeRO-3's
/// shard and windows.
pub enum Source<'a, S> {
    Whole(WholeParams<'a, S>),
    Gathered(Gathered<'a, S>),
}

impl<'a, S: Elem> Source<'a, S> {
    /// `params` as the model reads them: under ZeRO-3 (`zero3` and `dp`) the first
    /// `shard_len` elements are this rank's shard and the rest the windows, which hold nothing
    /// valid yet (the weights changed since they were gathered, or may have).
    pub fn new(
        params: ViewMut<'a, S>,
        zero3: Option<&'a mut Zero3>,
        dp: Option<&'a RefCell<DataParallel>>,
        shard_len: usize,
    ) -> Self {
        match (zero3, dp) {
            (Some(z), Some(dp)) => {
                z.invalidate();
                let (shard, windows) = params.split_at_mut(shard_len);
                Source::Gathered(z.source(dp, shard.into_view(), windows))
            }
            _ => Source::Whole(WholeParams(params.into_view())),
        }
    }

    /// `--offload params`: `windows` on `dev` filled unit by unit from `host` by `z`'s
    /// schedule; they hold nothing valid yet (the weights changed since they were uploaded).
    pub fn streamed(
        windows: ViewMut<'a, S>,
        host: View<'a, S>,
        z: &'a mut Zero3,
        dev: &'a dyn DeviceAlloc,
    ) -> Self {
        z.invalidate();
        Source::Gathered(z.streamed(host, windows, dev))
    }

    /// A micro-batch's forward and backward (or, with `eval`, a forward alone) begins.
    pub fn begin(&mut self, eval: bool) {
        if let Source::Gathered(g) = self {
            g.z.begin(eval);
        }
    }

    pub fn get(&mut self) -> &mut dyn ParamSource<S> {
        match self {
            Source::Whole(w) => w,
            Source::Gathered(g) => g,
        }
    }

    /// Fails with the first error of a gather since the last check.
    pub fn check(&mut self) -> Result<()> {
        match self {
            Source::Gathered(g) => match g.z.take_error() {
                Some(e) => bail!("{e}"),
                None => Ok(()),
            },
            Source::Whole(_) => Ok(()),
        }
    }
}
