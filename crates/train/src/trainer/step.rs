//! The training step of one rank: the micro-batch loop, the gradient sync it reports to
//! (`ferrotron_dist::grad_sync::GradSync`: DDP, ZeRO-1/2/3 or one replica, chosen once per step), and
//! the update (`update.rs`). It names no parallel dimension: the model's groups report their
//! failures through the mesh, the schedule chosen when the trainer was built
//! (`step_schedule.rs`) runs the pipeline's program or this loop, and the parameters come
//! from a source that may gather them (ZeRO-3).

use super::cuda_graph::{Graphed, Placement};
use super::*;
use ferrotron_dist::grad_sync::GradSync;
use ferrotron_engine::model::ParamSource;

impl Trainer {
    /// The step on typed weights and gradients: forward and backward of every micro-batch,
    /// the overflow check (fp16), clipping and AdamW. Returns the loss, the (unscaled)
    /// gradient norm, the learning rate and, for a skipped step, the loss scaler's decision.
    pub(super) fn step_typed<S: Elem, G: Elem>(
        &mut self,
        step: u64,
        params: ViewMut<'_, S>,
        grads: ViewMut<'_, G>,
    ) -> Result<Stepped> {
        // The loader never pads, so every position has a target: the loss of each micro-batch
        // is normalised by the target count of the whole step (every rank's), and summing
        // micro-batch gradients gives the gradient of the global mean loss.
        let num_targets = self.global_batch_tokens() as usize;
        if self.streaming.is_some() {
            return self.step_streamed(step, params, grads, num_targets);
        }
        // The backward's gradient reports and ZeRO-3's parameter requests both talk to the
        // data-parallel group, one after the other: they share it for the step.
        let dp = self.mesh.dp.take().map(RefCell::new);
        let out = self.step_shared(step, params, grads, dp.as_ref(), num_targets);
        self.mesh.dp = dp.map(RefCell::into_inner);
        out
    }

    fn step_shared<S: Elem, G: Elem>(
        &mut self,
        step: u64,
        mut params: ViewMut<'_, S>,
        grads: ViewMut<'_, G>,
        dp: Option<&RefCell<DataParallel>>,
        num_targets: usize,
    ) -> Result<Stepped> {
        let layout = self.grad_layout.clone();
        let mut grads = layout.split(grads);
        let (buf, mut sync) = grads.sync(dp, self.mesh.partial_norms());
        let loss = self.forward_backward(step, params.rb(), buf, &mut sync, dp, num_targets)?;
        // The micro-batches are done: no activations until the next step.
        if let Some(a) = &mut self.pool.arena {
            a.trim();
        }
        if injected_nan(step) && self.dev.is_none() {
            grads.poison(G::from_f32(f32::NAN));
        }
        self.update(step, params, &grads, dp, loss)
    }

    /// Forward and backward of every micro-batch of the step, in order, each backward handing
    /// its gradients to `sync` as it completes them; returns the micro-batches' loss.
    pub(super) fn micro_batches<S: Elem, G: Elem>(
        &mut self,
        step: u64,
        src: &mut Source<'_, S>,
        grads: &mut dyn GradBuf<G>,
        sync: &mut dyn GradSync<G>,
        num_targets: usize,
    ) -> Result<LossSum> {
        let batch = self.batch();
        let k: &dyn Kernels<S, G> = &self.kernels;
        let loss_scale = self.scaler.as_ref().map_or(1.0, |s| s.scale);
        let mut loss = LossSum::default();
        let last_mb = self.cfg.data.grad_acc - 1;
        for mb in 0..self.cfg.data.grad_acc {
            self.loader.next_into(&mut self.tokens, &mut self.targets)?;
            let (tokens, targets) =
                batch_views(&self.kernels, &mut self.dev, &self.tokens, &self.targets);
            let tf = Instant::now();
            // `--cuda-graph`: from this process's third step on (untraced) the micro-batch is a
            // graph's launch, captured from this eager run the first time.
            let graphed = match &mut self.graph {
                Some(g) if g.on => {
                    let at = Placement {
                        arena: self.pool.hold_arena().unwrap_or(0),
                        tokens: tokens.as_ptr() as usize,
                        targets: targets.as_ptr() as usize,
                        state: g.state,
                        loss_scale: loss_scale.to_bits(),
                    };
                    Some((g.before(&self.kernels.inner, at)?, at))
                }
                _ => None,
            };
            if let Some((Graphed::Replayed, _)) = graphed {
                // The loss is the device's sum (`take_loss`); its count the host's, as the
                // eager forward's (`count_targets` from the host's copy).
                let vocab = self.model.full_config().vocab;
                loss.count += self
                    .targets
                    .iter()
                    .filter(|&&t| (t as usize) < vocab)
                    .count();
                self.kernels.phase("micro_batch_graph", tf, step, mb);
                continue;
            }
            self.pool.enter(step, mb, Running::Forward);
            sync.begin(grads);
            src.begin(false);
            let (acts, l) = self.model.forward_train_scaled(
                k,
                &mut self.pool,
                src.get(),
                grads,
                batch,
                &tokens,
                &targets,
                num_targets,
                loss_scale,
            );
            src.check()?;
            self.mesh.check()?;
            self.kernels.phase("forward", tf, step, mb);
            let tb = Instant::now();
            self.pool.enter(step, mb, Running::Backward);
            let pool = &mut self.pool;
            let src_now: &mut dyn ParamSource<S> = src.get();
            if sync.syncs(mb == last_mb) {
                let done = &mut |d: GradsDone, g: &mut dyn GradBuf<G>| sync.ready(d, g);
                (self.model).backward_notify(k, pool, src_now, grads, acts, &tokens, done);
                sync.finish(grads)?;
            } else {
                let done = &mut |_: GradsDone, _: &mut dyn GradBuf<G>| {};
                (self.model).backward_notify(k, pool, src_now, grads, acts, &tokens, done);
            }
            src.check()?;
            self.mesh.check()?;
            self.pool.enter(step, mb, Running::Idle);
            self.kernels.phase("backward", tb, step, mb);
            if let (Some((Graphed::Capture, at)), Some(g)) = (graphed, &mut self.graph) {
                g.captured(&self.kernels.inner, at)?;
            }
            loss.sum += l.sum;
            loss.count += l.count;
        }
        Ok(loss)
    }
}
