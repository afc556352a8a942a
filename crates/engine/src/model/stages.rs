//! Stage entry points: the training step of [`Llama`] cut where the parallel trainers need to
//! cut it. Embedding, a forward over any range of layers, the fused head with the loss, and
//! their backwards are each callable alone, so a pipeline stage runs only its layers (and the
//! embedding or the head when it holds them), and data parallelism / ZeRO hear, after each
//! layer's backward, which parameter gradients are now complete for the micro-batch
//! ([`GradsDone`]) and can start their reduction while the backward goes on.
//!
//! [`Llama::forward_train_scaled`] and [`Llama::backward`] are these stages in order; running
//! them by hand gives the same buffers in the same order and the same numbers, bit for bit.

use super::activations::{BatchShape, GradScratch, LayerActs, LossSum};
use super::buffers::{Buf, BufName, BufferPool};
use super::grad_buf::GradBuf;
use super::llama::Llama;
use super::param_buf::{ParamSource, Unit};
use super::params::LayerIdx;
use crate::dtype::Elem;
use crate::kernels::{Accum, AsView, AsViewMut, Kernels, View, ViewMut};
use ferrotron_plan::tensors::{Edge, LayerTensor};
use std::ops::Range;

/// What the head's forward leaves for its backward.
#[derive(Debug)]
pub struct HeadActs<S> {
    /// `act.final_norm.input` `[N, C]`: the last layer's output.
    pub final_input: Buf<S>,
    /// `act.final_norm.rstd` `[N]`.
    pub final_rstd: Buf<f32>,
    /// `act.final_norm.out` `[N, C]`, holding d(loss)/d(final_norm.out) after the fused head.
    pub final_out_grad: Buf<S>,
}

/// The backward between stages: d(residual stream) at the current layer boundary
/// (`grad.act.resid`) and the scratch every layer's backward shares (`grad.act.*`).
pub struct BackwardState<S>(GradScratch<S>);

impl<S: Elem> BackwardState<S> {
    /// The scratch of a stage whose backward starts from a gradient it receives (a pipeline
    /// stage without the head): write it into [`BackwardState::resid_grad_mut`].
    pub fn new(model: &Llama, pool: &mut dyn BufferPool, batch: BatchShape) -> Self {
        let name = BufName::Edge(Edge::GradResid);
        let resid = model.buf(pool, name, batch.n());
        BackwardState(GradScratch::new(model, pool, batch, resid))
    }

    /// d(loss)/d(residual stream) at the boundary reached so far (after
    /// [`Llama::layers_backward`] of layers `a..b`: the gradient of layer `a`'s input).
    pub fn resid_grad(&self) -> View<'_, S> {
        self.0.resid.view()
    }

    pub fn resid_grad_mut(&mut self) -> ViewMut<'_, S> {
        self.0.resid.view_mut()
    }

    /// Returns every scratch buffer to the pool (a stage without the embedding ends here).
    pub fn free(self, pool: &mut dyn BufferPool) {
        self.0.free(pool);
    }
}

/// Parameter gradients a backward step has completed for the current micro-batch.
#[derive(Clone, Copy, Debug)]
pub enum GradsDone<'a> {
    /// The final norm (`model.norm.weight`), after the head's backward.
    FinalNorm(&'a Range<usize>),
    /// Every tensor of decoder layer `i`, after its backward.
    Layer(usize, &'a LayerIdx),
    /// The embedding, after the embedding's backward (with tied embeddings it also holds the
    /// LM head's gradient, which the head's forward accumulated). An untied LM head's gradient
    /// is complete when the head's forward returns.
    Embedding(&'a Range<usize>),
}

impl Llama {
    /// Embedding lookup: token ids → `act.layers.0.input`.
    pub fn embed_forward<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &mut dyn ParamSource<S>,
        tokens: &(impl AsView<u32> + ?Sized),
    ) -> Buf<S> {
        let c = self.config.hidden;
        self.reset_router_load();
        let name = BufName::Layer(0, LayerTensor::Input);
        let tokens = tokens.view();
        let mut x = self.buf(pool, name, tokens.len());
        let p = params.unit(Unit::Embedding);
        let wte = p.slice(self.params.embed.clone());
        match &self.tp {
            None => k.embedding_forward(tokens, wte, c, x.view_mut()),
            Some(tp) => {
                // Vocabulary-parallel: this rank's rows, the others' tokens zero, summed (under
                // sequence parallelism reduce-scattered to this rank's tokens).
                let first = tp.vocab_first();
                let mut full = self.sp_full::<S>(pool, tokens.len());
                match full.as_mut() {
                    Some(f) => {
                        k.embedding_forward_shard(tokens, wte, c, first, f.view_mut());
                        tp.scatter_rows(f.view(), x.view_mut());
                    }
                    None => {
                        k.embedding_forward_shard(tokens, wte, c, first, x.view_mut());
                        self.tp_sum(x.view_mut());
                    }
                }
                self.free_sp_full(pool, full);
            }
        }
        x
    }

    /// The input buffer of layer `i` for `tokens` tokens: where a pipeline stage puts the
    /// activation it receives for its chunk starting at layer `i`.
    pub fn layer_input<S: Elem>(
        &self,
        pool: &mut dyn BufferPool,
        i: usize,
        tokens: usize,
    ) -> Buf<S> {
        self.buf(pool, BufName::Layer(i as u32, LayerTensor::Input), tokens)
    }

    /// Gives back layer `i`'s input buffer: a pipeline stage's output of its chunk ending at
    /// layer `i − 1`, once sent to the next stage.
    pub fn free_layer_input<S: Elem>(&self, pool: &mut dyn BufferPool, i: usize, x: Buf<S>) {
        pool.free(BufName::Layer(i as u32, LayerTensor::Input), x);
    }

    /// Forward of decoder layers `layers` from their input `x`; returns their saved activations
    /// (first layer first) and the output of the last one (the next layer's input buffer, or
    /// `act.final_norm.input` after the model's last layer).
    pub fn layers_forward<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &mut dyn ParamSource<S>,
        batch: BatchShape,
        layers: Range<usize>,
        mut x: Buf<S>,
    ) -> (Vec<LayerActs<S>>, Buf<S>) {
        assert!(
            layers.end <= self.config.layers,
            "layers {layers:?} out of range"
        );
        // The list itself is the last micro-batch's (given back by `layers_backward`).
        let mut acts: Vec<LayerActs<S>> = self.spares.take().unwrap_or_default();
        acts.reserve(layers.len());
        for i in layers {
            let p = params.unit(Unit::Layer(i));
            let (a, out) = self.layer_forward(k, pool, p, i, batch, x);
            acts.push(a);
            x = out;
        }
        (acts, x)
    }

    /// The final norm, LM head and cross-entropy of the last layer's output `x`, with the
    /// head's backward fused in: accumulates `d lm_head.weight` into `grads` and leaves
    /// d(loss)/d(final_norm.out) for [`Llama::head_backward`]. The loss is multiplied by
    /// `loss_scale / num_target_tokens` before the backward (see `forward_train_scaled`).
    #[allow(clippy::too_many_arguments)]
    pub fn head_forward<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &mut dyn ParamSource<S>,
        grads: &mut dyn GradBuf<G>,
        x: Buf<S>,
        targets: &(impl AsView<u32> + ?Sized),
        num_target_tokens: usize,
        loss_scale: f32,
    ) -> (HeadActs<S>, LossSum) {
        let scale = if num_target_tokens == 0 {
            0.0
        } else {
            loss_scale / num_target_tokens as f32
        };
        let p = params.unit(Unit::Head);
        let (final_rstd, final_out_grad, loss) =
            self.head(k, pool, p, &x, targets, Some((grads, scale)));
        let loss = self.router_loss(loss, num_target_tokens, loss_scale);
        let acts = HeadActs {
            final_input: x,
            final_rstd,
            final_out_grad,
        };
        (acts, loss)
    }

    /// Backward of the final norm: d(last layer output), in a new [`BackwardState`] whose
    /// scratch the layers' backward uses. The final_norm buffers are freed before the scratch
    /// arrives (the plan's order).
    #[allow(clippy::too_many_arguments)]
    pub fn head_backward<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &mut dyn ParamSource<S>,
        grads: &mut dyn GradBuf<G>,
        head: HeadActs<S>,
        batch: BatchShape,
        done: &mut dyn FnMut(GradsDone, &mut dyn GradBuf<G>),
    ) -> BackwardState<S> {
        let n = batch.n();
        let g = BufName::Edge;
        let mut resid = self.buf(pool, g(Edge::GradResid), n);
        let nl = self.rows(n);
        k.rmsnorm_backward(
            self.norm(nl),
            head.final_out_grad.view().slice(..nl * self.config.hidden),
            head.final_input.view(),
            params.unit(Unit::Head).slice(self.params.norm.clone()),
            head.final_rstd.view(),
            resid.view_mut(),
            Accum::Overwrite,
            grads.slice_mut(self.params.norm.clone()),
        );
        pool.free(g(Edge::FinalNormOut), head.final_out_grad);
        pool.free(g(Edge::FinalNormRstd), head.final_rstd);
        pool.free(g(Edge::FinalNormInput), head.final_input);
        done(GradsDone::FinalNorm(&self.params.norm), grads);
        BackwardState(GradScratch::new(self, pool, batch, resid))
    }

    /// Backward of decoder layers `layers` (their activations `acts` as `layers_forward`
    /// returned them), last layer first: on entry the state holds d(output of the last of
    /// them), on exit d(input of the first). Calls `done` after each layer.
    #[allow(clippy::too_many_arguments)]
    pub fn layers_backward<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &mut dyn ParamSource<S>,
        grads: &mut dyn GradBuf<G>,
        batch: BatchShape,
        layers: Range<usize>,
        mut acts: Vec<LayerActs<S>>,
        state: &mut BackwardState<S>,
        done: &mut dyn FnMut(GradsDone, &mut dyn GradBuf<G>),
    ) {
        assert_eq!(
            acts.len(),
            layers.len(),
            "one LayerActs per layer of {layers:?}"
        );
        for i in layers.rev() {
            let a = acts.pop().expect("checked length");
            let p = params.unit(Unit::Layer(i));
            let a = self.rebuild(k, pool, p, i, batch, a);
            self.layer_backward(k, pool, p, grads, i, batch, a, &mut state.0);
            done(GradsDone::Layer(i, &self.params.layers[i]), grads);
        }
        self.spares.give(acts);
    }

    /// Backward of the embedding from d(layer 0 input); frees the backward's scratch.
    pub fn embed_backward<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        grads: &mut dyn GradBuf<G>,
        tokens: &(impl AsView<u32> + ?Sized),
        state: BackwardState<S>,
        done: &mut dyn FnMut(GradsDone, &mut dyn GradBuf<G>),
    ) {
        let c = self.config.hidden;
        let range = self.params.embed.clone();
        let tokens = tokens.view();
        match &self.tp {
            None => k.embedding_backward(tokens, state.0.resid.view(), c, grads.slice_mut(range)),
            Some(tp) => {
                let first = tp.vocab_first();
                let mut full = self.sp_full::<S>(pool, tokens.len());
                let d = self.gathered_rows(state.0.resid.view(), full.as_mut());
                k.embedding_backward_shard(tokens, d, c, first, grads.slice_mut(range));
                self.free_sp_full(pool, full);
            }
        }
        state.free(pool);
        done(GradsDone::Embedding(&self.params.embed), grads);
    }
}
