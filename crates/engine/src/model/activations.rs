//! The activation buffers a training step keeps between forward and backward, by plan name
//! (`act.layers.{i}.<field>`, `act.final_norm.*`, `grad.act.*`).

use super::buffers::{Buf, BufName, BufferPool};
use crate::dtype::Elem;
use ferrotron_plan::tensors::{Edge, LayerTensor};

/// `B` sequences of `T` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchShape {
    pub b: usize,
    pub t: usize,
}

impl BatchShape {
    pub fn n(&self) -> usize {
        self.b * self.t
    }
}

/// Sum of per-token losses and how many tokens had a (non-ignored) target.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossSum {
    pub sum: f64,
    pub count: usize,
}

impl LossSum {
    /// Mean loss over the counted targets (what `F.cross_entropy` reports).
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum / self.count as f64
        }
    }
}

/// Activations of one decoder layer (sizes in the module docs of the plan). Between forward and
/// backward a tensor the recompute policy drops is an empty `Vec` (no allocation).
#[derive(Debug, Default)]
pub struct LayerActs<S> {
    /// Residual stream entering the layer `[N, C]`.
    pub input: Buf<S>,
    pub ln1_rstd: Buf<f32>,
    pub ln1_out: Buf<S>,
    /// Post-RoPE `[N, H·D]`.
    pub q: Buf<S>,
    /// Post-RoPE `[N, KV·D]`.
    pub k: Buf<S>,
    pub v: Buf<S>,
    /// `[B, H, T]`.
    pub attn_lse: Buf<f32>,
    pub attn_out: Buf<S>,
    pub resid_mid: Buf<S>,
    pub ln2_rstd: Buf<f32>,
    pub ln2_out: Buf<S>,
    pub gate: Buf<S>,
    pub up: Buf<S>,
    pub swiglu: Buf<S>,
    /// A sparse MLP's router logits `[N, E]`, weights and experts `[N, k]`, and the token
    /// copies grouped by expert `[N·k, C]` (its gate/up/swiglu are then `[N·k, F]`).
    pub router_logits: Buf<f32>,
    pub router_weights: Buf<f32>,
    pub router_index: Buf<u32>,
    pub expert_in: Buf<S>,
}

impl<S: Elem> LayerActs<S> {
    /// Returns tensor `t` to the pool as `name`, leaving an empty buffer.
    pub fn release(&mut self, t: LayerTensor, pool: &mut dyn BufferPool, name: BufName) {
        use std::mem::take;
        match t {
            LayerTensor::Ln1Rstd => pool.free(name, take(&mut self.ln1_rstd)),
            LayerTensor::AttnLse => pool.free(name, take(&mut self.attn_lse)),
            LayerTensor::Ln2Rstd => pool.free(name, take(&mut self.ln2_rstd)),
            LayerTensor::RouterLogits => pool.free(name, take(&mut self.router_logits)),
            LayerTensor::RouterWeights => pool.free(name, take(&mut self.router_weights)),
            LayerTensor::RouterIndex => pool.free(name, take(&mut self.router_index)),
            _ => pool.free(name, take(self.storage_mut(t))),
        }
    }

    /// The storage-typed tensor `t`.
    fn storage_mut(&mut self, t: LayerTensor) -> &mut Buf<S> {
        match t {
            LayerTensor::Input => &mut self.input,
            LayerTensor::Ln1Out => &mut self.ln1_out,
            LayerTensor::Q => &mut self.q,
            LayerTensor::K => &mut self.k,
            LayerTensor::V => &mut self.v,
            LayerTensor::AttnOut => &mut self.attn_out,
            LayerTensor::ResidMid => &mut self.resid_mid,
            LayerTensor::Ln2Out => &mut self.ln2_out,
            LayerTensor::Gate => &mut self.gate,
            LayerTensor::Up => &mut self.up,
            LayerTensor::Swiglu => &mut self.swiglu,
            LayerTensor::ExpertIn => &mut self.expert_in,
            _ => panic!("a Llama layer has no tensor `{}`", t.name()),
        }
    }
}

/// Everything the training forward leaves for the backward.
#[derive(Debug)]
pub struct Activations<S> {
    pub batch: BatchShape,
    /// Layer activations, layer 0 first; the backward pops from the end.
    pub layers: Vec<LayerActs<S>>,
    /// `act.final_norm.input` `[N, C]`: the last layer's output.
    pub final_input: Buf<S>,
    /// `act.final_norm.rstd` `[N]`.
    pub final_rstd: Buf<f32>,
    /// `act.final_norm.out` `[N, C]`, holding d(loss)/d(final_norm.out) after the fused head.
    pub final_out_grad: Buf<S>,
}

/// Backward scratch, shared by all layers (`grad.act.*`).
pub struct GradScratch<S> {
    pub(crate) resid: Buf<S>,
    pub(crate) ln_out: Buf<S>,
    pub(crate) q: Buf<S>,
    pub(crate) k: Buf<S>,
    pub(crate) v: Buf<S>,
    pub(crate) attn_out: Buf<S>,
    pub(crate) gate: Buf<S>,
    pub(crate) up: Buf<S>,
    pub(crate) swiglu: Buf<S>,
    /// A MoE model's: `grad.act.router_logits`, `grad.act.router_weights`, `act.moe.rows`.
    pub(crate) router_logits: Buf<f32>,
    pub(crate) router_weights: Buf<f32>,
    pub(crate) rows: Buf<S>,
}

impl<S: Elem> GradScratch<S> {
    /// The scratch of a backward whose d(residual stream) is `resid` (`grad.act.resid`).
    pub(crate) fn new(
        model: &super::llama::Llama,
        pool: &mut dyn BufferPool,
        batch: BatchShape,
        resid: Buf<S>,
    ) -> Self {
        let mut b = Edge::SCRATCH.map(|e| {
            let name = BufName::Edge(e);
            model.buf(pool, name, batch.n())
        });
        let mut take = |i: usize| std::mem::take(&mut b[i]);
        let moe = model.config.moe.is_some();
        let mut f32s = Edge::MOE_SCRATCH
            .map(|e| moe.then(|| model.buf(pool, BufName::Edge(e), batch.n())))
            .map(Option::unwrap_or_default);
        let rows = match moe {
            true => model.buf(pool, BufName::Edge(Edge::ExpertRows), batch.n()),
            false => Buf::empty(),
        };
        GradScratch {
            router_logits: std::mem::take(&mut f32s[0]),
            router_weights: std::mem::take(&mut f32s[1]),
            rows,
            resid,
            ln_out: take(0),
            q: take(1),
            k: take(2),
            v: take(3),
            attn_out: take(4),
            gate: take(5),
            up: take(6),
            swiglu: take(7),
        }
    }

    /// Returns every buffer to the pool, `grad.act.resid` first.
    pub(crate) fn free(self, pool: &mut dyn BufferPool) {
        if !self.rows.is_empty() || !self.router_logits.is_empty() {
            pool.free(BufName::Edge(Edge::ExpertRows), self.rows);
            let [l, w] = Edge::MOE_SCRATCH;
            pool.free(BufName::Edge(l), self.router_logits);
            pool.free(BufName::Edge(w), self.router_weights);
        }
        pool.free(BufName::Edge(Edge::GradResid), self.resid);
        let bufs = [
            self.ln_out,
            self.q,
            self.k,
            self.v,
            self.attn_out,
            self.gate,
            self.up,
            self.swiglu,
        ];
        for (e, b) in Edge::SCRATCH.into_iter().zip(bufs) {
            pool.free(BufName::Edge(e), b);
        }
    }
}
