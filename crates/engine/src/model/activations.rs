//! The activation buffers a training step keeps between forward and backward, by plan name
//! (`act.layers.{i}.<field>`, `act.final_norm.*`, `grad.act.*`).

use super::buffers::{BufName, BufferPool};
use crate::dtype::Elem;

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
    pub input: Vec<S>,
    pub ln1_rstd: Vec<f32>,
    pub ln1_out: Vec<S>,
    /// Post-RoPE `[N, H·D]`.
    pub q: Vec<S>,
    /// Post-RoPE `[N, KV·D]`.
    pub k: Vec<S>,
    pub v: Vec<S>,
    /// `[B, H, T]`.
    pub attn_lse: Vec<f32>,
    pub attn_out: Vec<S>,
    pub resid_mid: Vec<S>,
    pub ln2_rstd: Vec<f32>,
    pub ln2_out: Vec<S>,
    pub gate: Vec<S>,
    pub up: Vec<S>,
    pub swiglu: Vec<S>,
}

impl<S: Elem> LayerActs<S> {
    /// Returns the tensor named `field` (one of [`super::recompute::LAYER_FIELDS`]) to the
    /// pool as `name`, leaving an empty `Vec`.
    pub fn release(&mut self, field: &str, pool: &mut dyn BufferPool, name: BufName) {
        use std::mem::take;
        match field {
            "ln1_rstd" => pool.free(name, take(&mut self.ln1_rstd)),
            "attn_lse" => pool.free(name, take(&mut self.attn_lse)),
            "ln2_rstd" => pool.free(name, take(&mut self.ln2_rstd)),
            _ => pool.free(name, take(self.field_mut(field))),
        }
    }

    /// The storage-typed tensor named `field`.
    fn field_mut(&mut self, field: &str) -> &mut Vec<S> {
        match field {
            "input" => &mut self.input,
            "ln1_out" => &mut self.ln1_out,
            "q" => &mut self.q,
            "k" => &mut self.k,
            "v" => &mut self.v,
            "attn_out" => &mut self.attn_out,
            "resid_mid" => &mut self.resid_mid,
            "ln2_out" => &mut self.ln2_out,
            "gate" => &mut self.gate,
            "up" => &mut self.up,
            "swiglu" => &mut self.swiglu,
            _ => panic!("no layer tensor `{field}`"),
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
    pub final_input: Vec<S>,
    /// `act.final_norm.rstd` `[N]`.
    pub final_rstd: Vec<f32>,
    /// `act.final_norm.out` `[N, C]`, holding d(loss)/d(final_norm.out) after the fused head.
    pub final_out_grad: Vec<S>,
}

/// Backward scratch, shared by all layers (`grad.act.*`).
pub(crate) struct GradScratch<S> {
    pub(crate) resid: Vec<S>,
    pub(crate) ln_out: Vec<S>,
    pub(crate) q: Vec<S>,
    pub(crate) k: Vec<S>,
    pub(crate) v: Vec<S>,
    pub(crate) attn_out: Vec<S>,
    pub(crate) gate: Vec<S>,
    pub(crate) up: Vec<S>,
    pub(crate) swiglu: Vec<S>,
}
