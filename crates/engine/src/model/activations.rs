//! The activation buffers a training step keeps between forward and backward, by plan name
//! (`act.layers.{i}.<field>`, `act.final_norm.*`, `grad.act.*`).

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
pub struct LayerActs {
    /// Residual stream entering the layer `[N, C]`.
    pub input: Vec<f32>,
    pub ln1_rstd: Vec<f32>,
    pub ln1_out: Vec<f32>,
    /// Post-RoPE `[N, H·D]`.
    pub q: Vec<f32>,
    /// Post-RoPE `[N, KV·D]`.
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// `[B, H, T]`.
    pub attn_lse: Vec<f32>,
    pub attn_out: Vec<f32>,
    pub resid_mid: Vec<f32>,
    pub ln2_rstd: Vec<f32>,
    pub ln2_out: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub swiglu: Vec<f32>,
}

impl LayerActs {
    /// The tensor named `field` (one of [`super::recompute::LAYER_FIELDS`]).
    pub fn field_mut(&mut self, field: &str) -> &mut Vec<f32> {
        match field {
            "input" => &mut self.input,
            "ln1_rstd" => &mut self.ln1_rstd,
            "ln1_out" => &mut self.ln1_out,
            "q" => &mut self.q,
            "k" => &mut self.k,
            "v" => &mut self.v,
            "attn_lse" => &mut self.attn_lse,
            "attn_out" => &mut self.attn_out,
            "resid_mid" => &mut self.resid_mid,
            "ln2_rstd" => &mut self.ln2_rstd,
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
pub struct Activations {
    pub batch: BatchShape,
    /// Layer activations, layer 0 first; the backward pops from the end.
    pub layers: Vec<LayerActs>,
    /// `act.final_norm.input` `[N, C]`: the last layer's output.
    pub final_input: Vec<f32>,
    /// `act.final_norm.rstd` `[N]`.
    pub final_rstd: Vec<f32>,
    /// `act.final_norm.out` `[N, C]`, holding d(loss)/d(final_norm.out) after the fused head.
    pub final_out_grad: Vec<f32>,
}

/// Backward scratch, shared by all layers (`grad.act.*`).
pub(crate) struct GradScratch {
    pub(crate) resid: Vec<f32>,
    pub(crate) ln_out: Vec<f32>,
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    pub(crate) attn_out: Vec<f32>,
    pub(crate) gate: Vec<f32>,
    pub(crate) up: Vec<f32>,
    pub(crate) swiglu: Vec<f32>,
}
