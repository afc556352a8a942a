//! A pipeline stage's part of the training step: its forward and backward work in the
//! schedule's order (`ferrotron_dist::pipeline`), then what the stages settle together before the
//! optimizer: the tied embedding's two gradients, the data-parallel reduction of the stage's
//! gradients, and the loss.

use super::{batch_views, Trainer};
use crate::memory::pool::Running;
use anyhow::Result;
use ferrotron_dist::data_parallel::DataParallel;
use ferrotron_dist::grad_sync::{GradSync, Local, Replicas, SeqParallelNorms};
use ferrotron_dist::small_sums::SmallSums;
use ferrotron_engine::kernels::{AsView, AsViewMut, Kernels, View};
use ferrotron_engine::model::{
    BackwardState, GradBuf, GradsDone, HeadActs, LayerActs, LossSum, WholeParams,
};
use ferrotron_engine::Elem;
use ferrotron_plan::schedule::{Message, Work};
use std::cell::RefCell;
use std::ops::Range;
use std::time::Instant;

/// What a micro-batch's forward on one chunk leaves for its backward.
struct InFlight<S> {
    acts: Vec<LayerActs<S>>,
    head: Option<HeadActs<S>>,
}

impl Trainer {
    /// Runs the stage's work of one step; returns the loss of the micro-batches whose head
    /// ran here, summed over the stages (every stage reports the same).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn pipeline_work<S: Elem, G: Elem>(
        &mut self,
        step: u64,
        params: View<'_, S>,
        grads: &mut dyn GradBuf<G>,
        dp: Option<&RefCell<DataParallel>>,
        num_targets: usize,
        loss_scale: f32,
    ) -> Result<LossSum> {
        let mut pp = self.mesh.pp.take().expect("a pipeline stage");
        let t0 = Instant::now();
        let r = (pp.begin())
            .and_then(|()| self.run_stage(&mut pp, step, params, grads, num_targets, loss_scale));
        let r = r.and_then(|loss| pp.flush().map(|_| loss));
        if let Some(a) = &mut self.pool.arena {
            a.set_slot(0);
        }
        pp.span += t0.elapsed();
        let r = r.and_then(|loss| {
            self.settle(&mut pp, grads, dp)?;
            let loss = super::update::device_loss(&self.kernels, loss);
            let [sum, count] = pp.sum_f64([loss.sum, loss.count as f64], "pipeline loss")?;
            Ok(LossSum {
                sum,
                count: count.round() as usize,
            })
        });
        self.mesh.pp = Some(pp);
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn run_stage<S: Elem, G: Elem>(
        &mut self,
        pp: &mut ferrotron_dist::pipeline::Pipeline,
        step: u64,
        params: View<'_, S>,
        grads: &mut dyn GradBuf<G>,
        num_targets: usize,
        loss_scale: f32,
    ) -> Result<LossSum> {
        let batch = self.batch();
        let last_mb = self.cfg.data.grad_acc - 1;
        let width = (0..pp.chunks()).map(|c| pp.slots_of(c)).max().unwrap_or(1);
        // The stage's table of in-flight micro-batches: made by the first step, then reused
        // (every backward empties its entry, so it is all `None` between steps).
        let mut held: Box<Vec<Option<InFlight<S>>>> = pp
            .in_flight
            .take()
            .and_then(|h| h.downcast().ok())
            .unwrap_or_default();
        held.clear();
        held.resize_with((pp.chunks() * width) as usize, || None);
        let mut src = WholeParams(params);
        let mut norms = SeqParallelNorms {
            tp: self.mesh.partial_norms(),
            inner: Local,
        };
        let mut loss = LossSum::default();
        for i in 0..pp.work.len() {
            let (w, slot) = (pp.work[i], pp.slots[i]);
            let messages = pp.messages(w);
            let (recv, send) = messages;
            if let Some(a) = &mut self.pool.arena {
                a.set_slot(slot);
            }
            let (Work::F { mb, chunk } | Work::B { mb, chunk }) = w;
            let range = pp.chunk_layers(chunk, self.model.config.layers);
            let at = (chunk * width + slot) as usize;
            let b = pp.batch_slot[mb as usize];
            let t0 = Instant::now();
            match w {
                Work::F { .. } => {
                    let (at_batch, scale) = ((step, mb, chunk, b), (num_targets, loss_scale));
                    let (f, l) =
                        self.forward_chunk(pp, &mut src, grads, at_batch, range, messages, scale)?;
                    (loss.sum, loss.count) = (loss.sum + l.sum, loss.count + l.count);
                    held[at] = Some(f);
                    self.kernels.phase("forward", t0, step, mb);
                }
                Work::B { .. } => {
                    let f = held[at].take().expect("a backward follows its forward");
                    let k: &dyn Kernels<S, G> = &self.kernels;
                    let (model, pool) = (&self.model, &mut self.pool);
                    // Sequence parallelism leaves each rank its tokens' share of the norms'
                    // gradients: summed over the group once the last micro-batch's are in.
                    let last = mb == last_mb;
                    let done = &mut |d: GradsDone, g: &mut dyn GradBuf<G>| {
                        if GradSync::<G>::syncs(&norms, last) {
                            norms.ready(d, g)
                        }
                    };
                    let mut state = match (f.head, recv) {
                        (Some(h), _) => {
                            model.head_backward(k, pool, &mut src, grads, h, batch, done)
                        }
                        (None, Some(m)) => {
                            let mut s = BackwardState::new(model, pool, batch);
                            pp.recv(m, s.resid_grad_mut())?;
                            s
                        }
                        (None, None) => unreachable!("a chunk without the head gets a gradient"),
                    };
                    model.layers_backward(
                        k, pool, &mut src, grads, batch, range, f.acts, &mut state, done,
                    );
                    match send {
                        None => {
                            let (tokens, targets) =
                                batch_of(&self.tokens, &self.targets, &self.batches, b);
                            let (tokens, _) =
                                batch_views(&self.kernels, &mut self.dev, tokens, targets);
                            model.embed_backward(k, pool, grads, &tokens, state, done)
                        }
                        Some(m) => {
                            pp.send(m, state.resid_grad())?;
                            state.free(pool);
                        }
                    }
                    self.kernels.phase("backward", t0, step, mb);
                }
            }
            self.mesh.check()?;
        }
        pp.in_flight = Some(held);
        Ok(loss)
    }

    /// One forward of micro-batch `mb` on this stage's chunk `chunk` (its layers `range`, its
    /// batch in slot `b`): the chunk's input from the embedding or the previous stage, its
    /// layers, then its output sent to the next stage or, where the head is, the loss. Returns
    /// what the micro-batch's backward on the chunk needs, and the loss (zero without the head).
    #[allow(clippy::too_many_arguments)]
    fn forward_chunk<S: Elem, G: Elem>(
        &mut self,
        pp: &mut ferrotron_dist::pipeline::Pipeline,
        src: &mut WholeParams<'_, S>,
        grads: &mut dyn GradBuf<G>,
        (step, mb, chunk, b): (u64, u64, u64, usize),
        range: Range<usize>,
        (recv, send): (Option<Message>, Option<Message>),
        (num_targets, loss_scale): (usize, f32),
    ) -> Result<(InFlight<S>, LossSum)> {
        let batch = self.batch();
        let k: &dyn Kernels<S, G> = &self.kernels;
        let model = &self.model;
        let mut loss = LossSum::default();
        self.pool.enter(step, mb, Running::Idle);
        // Every stage reads each micro-batch (the loader's position stays the same
        // on every rank): the first uses its tokens, the last its targets.
        if chunk == 0 {
            let slots = (&mut self.tokens, &mut self.targets, &mut self.batches[..]);
            load_slot(&mut self.loader, slots, b)?;
        }
        let (tokens, targets) = batch_of(&self.tokens, &self.targets, &self.batches, b);
        // On a device, the slot's batch is copied into the device's one.
        let (tokens, targets) = batch_views(&self.kernels, &mut self.dev, tokens, targets);
        let pool = &mut self.pool;
        let x = match recv {
            None => model.embed_forward(k, pool, src, &tokens),
            Some(m) => {
                let mut x = model.layer_input(pool, range.start, batch.n());
                pp.recv(m, x.view_mut())?;
                x
            }
        };
        let (acts, out) = model.layers_forward(k, pool, src, batch, range.clone(), x);
        let head = match send {
            Some(m) => {
                pp.send(m, out.view())?;
                model.free_layer_input(pool, range.end, out);
                None
            }
            None => {
                let (h, l) =
                    model.head_forward(k, pool, src, grads, out, &targets, num_targets, loss_scale);
                loss = l;
                Some(h)
            }
        };
        Ok((InFlight { acts, head }, loss))
    }

    /// After the stage's last backward: the tied embedding's copies summed over the first and
    /// last stages, then the stage's gradients reduced over its data-parallel group (all at
    /// once: a stage's chunks finish their last backward at different times).
    fn settle<G: Elem>(
        &mut self,
        pp: &mut ferrotron_dist::pipeline::Pipeline,
        grads: &mut dyn GradBuf<G>,
        dp: Option<&RefCell<DataParallel>>,
    ) -> Result<()> {
        let embed = self.model.params.embed.clone();
        if !embed.is_empty() {
            pp.sum_embedding(grads.slice_mut(embed.clone()))?;
        }
        let Some(dp) = dp else {
            return Ok(());
        };
        let mut sync = Replicas(dp);
        // The stage's gradients in the order a backward completes them: the final norm, its
        // layers last first, the embedding (absent parts have empty ranges).
        let p = &self.model.params;
        let norm = (!p.norm.is_empty()).then_some(GradsDone::FinalNorm(&p.norm));
        let layers = (0..p.layers.len())
            .rev()
            .filter(|&i| !p.layers[i].ln1.is_empty())
            .map(|i| GradsDone::Layer(i, &p.layers[i]));
        let embedding = (!embed.is_empty()).then_some(GradsDone::Embedding(&embed));
        for d in norm.into_iter().chain(layers).chain(embedding) {
            sync.ready(d, grads);
        }
        sync.finish(grads)
    }
}

impl Trainer {
    /// The validation loss through the pipeline: each batch's forward, chunk by chunk, without
    /// gradients (every stage calls it; each reports the last stage's loss).
    pub(super) fn pipeline_eval<S: Elem>(&mut self, params: View<'_, S>) -> Result<LossSum> {
        let mut pp = self.mesh.pp.take().expect("a pipeline stage");
        let r = self.eval_stage(&mut pp, params).and_then(|loss| {
            let loss = super::update::device_loss(&self.kernels, loss);
            let [sum, count] = pp.sum_f64([loss.sum, loss.count as f64], "pipeline loss")?;
            Ok(LossSum {
                sum,
                count: count.round() as usize,
            })
        });
        pp.waits.clear();
        (pp.idle, pp.span) = Default::default();
        self.mesh.pp = Some(pp);
        r
    }

    fn eval_stage<S: Elem>(
        &mut self,
        pp: &mut ferrotron_dist::pipeline::Pipeline,
        params: View<'_, S>,
    ) -> Result<LossSum> {
        let mut loss = LossSum::default();
        let Some(val) = &self.val else {
            return Ok(loss);
        };
        let batch = self.batch();
        let k: &dyn Kernels<S> = &self.kernels;
        let layers = self.model.config.layers;
        let model = &self.model;
        let mut src = WholeParams(params);
        if let Some(a) = &mut self.pool.arena {
            a.set_slot(0);
        }
        for i in 0..val.num_batches() {
            val.batch_into(i, &mut self.tokens, &mut self.targets)?;
            let (tokens, targets) =
                batch_views(&self.kernels, &mut self.dev, &self.tokens, &self.targets);
            for chunk in 0..pp.chunks() {
                let w = Work::F {
                    mb: i as u64,
                    chunk,
                };
                let (recv, send) = pp.messages(w);
                let range = pp.chunk_layers(chunk, layers);
                let pool = &mut self.pool;
                let x = match recv {
                    None => model.embed_forward(k, pool, &mut src, &tokens),
                    Some(m) => {
                        let mut x = model.layer_input(pool, range.start, batch.n());
                        pp.recv(m, x.view_mut())?;
                        x
                    }
                };
                let out = model.layers_no_grad(k, pool, &mut src, batch, range.clone(), x);
                match send {
                    Some(m) => {
                        pp.send(m, out.view())?;
                        model.free_layer_input(pool, range.end, out);
                    }
                    None => {
                        let l = model.head_eval(k, pool, &mut src, out, &targets);
                        loss.sum += l.sum;
                        loss.count += l.count;
                    }
                }
                self.mesh.check()?;
            }
        }
        pp.flush()?;
        Ok(loss)
    }
}

/// The tokens and targets of batch slot `b`.
fn batch_of<'a>(
    tokens: &'a [u32],
    targets: &'a [u32],
    batches: &'a [(Vec<u32>, Vec<u32>)],
    b: usize,
) -> (&'a [u32], &'a [u32]) {
    match b {
        0 => (tokens, targets),
        _ => (&batches[b - 1].0, &batches[b - 1].1),
    }
}

/// Slot 0's tokens and targets, then the other batch slots'.
type Slots<'a> = (
    &'a mut Vec<u32>,
    &'a mut Vec<u32>,
    &'a mut [(Vec<u32>, Vec<u32>)],
);

/// The loader's next micro-batch into batch slot `b` (`slots`: slot 0's tokens and targets, then
/// the other slots').
fn load_slot(
    loader: &mut crate::data::Loader,
    (tokens, targets, batches): Slots<'_>,
    b: usize,
) -> Result<()> {
    let (t, y) = match b {
        0 => (tokens, targets),
        _ => {
            let (t, y) = &mut batches[b - 1];
            (t, y)
        }
    };
    Ok(loader.next_into(t, y)?)
}
