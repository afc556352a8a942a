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
pub struct GradScratch<S> {
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

/// The scratch buffers besides `grad.act.resid`, in the order they are allocated and freed.
const SCRATCH: [&str; 8] = [
    "grad.act.ln_out",
    "grad.act.q",
    "grad.act.k",
    "grad.act.v",
    "grad.act.attn_out",
    "grad.act.gate",
    "grad.act.up",
    "grad.act.swiglu",
];

impl<S: Elem> GradScratch<S> {
    /// The scratch of a backward whose d(residual stream) is `resid` (`grad.act.resid`).
    pub(crate) fn new(
        model: &super::llama::Llama,
        pool: &mut dyn BufferPool,
        batch: BatchShape,
        resid: Vec<S>,
    ) -> Self {
        let c = &model.config;
        let n = batch.n();
        let len = |name: &str| match name {
            "grad.act.ln_out" => n * c.hidden,
            "grad.act.q" | "grad.act.attn_out" => n * c.q_dim(),
            "grad.act.k" | "grad.act.v" => n * c.kv_dim(),
            _ => n * c.intermediate,
        };
        let mut b = SCRATCH.map(|name| pool.alloc(BufName::global(name), len(name)));
        let mut take = |i: usize| std::mem::take(&mut b[i]);
        GradScratch {
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
        pool.free(BufName::global("grad.act.resid"), self.resid);
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
        for (name, b) in SCRATCH.into_iter().zip(bufs) {
            pool.free(BufName::global(name), b);
        }
    }
}
