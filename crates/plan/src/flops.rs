//! Model FLOPs (for MFU) under the conventions frameworks use, and hardware FLOPs (for HFU).
//!
//! Convention (the default of docs/FORMULAS.md): a matmul of an [n, k] by [k, m] costs 2nkm
//! FLOPs; backward costs twice the forward. Per token of a sequence of length s:
//! - weights: 6 · (matmul parameters used by the token, the LM head included, the embedding
//!   lookup excluded) (Kaplan et al. 2020, §2.1: C ≈ 6N per token);
//! - attention scores and values: forward 2·2·s·(a·d) per layer for the full square, halved for
//!   the causal mask, so 6·L·s·(a·d) forward + backward per token (PaLM, Chowdhery et al. 2022,
//!   App. B, gives 12·L·h·s without the causal halving).

use crate::error::PlanError;
use crate::inventory::{count, inventory, Placement, Tensor};
use crate::model::{MlpAct, ModelSpec};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Model FLOPs per token at sequence length `seq`, causal attention.
pub fn model_flops_per_token(m: &ModelSpec, seq: u64) -> f64 {
    let p = count(m, &inventory(m));
    6.0 * p.matmul_active as f64 + 6.0 * m.layers as f64 * seq as f64 * m.score_width()
}

/// Forward FLOPs per token (a third of the model FLOPs), used to add recomputation to HFU.
pub fn forward_flops_per_token(m: &ModelSpec, seq: u64) -> f64 {
    model_flops_per_token(m, seq) / 3.0
}

/// How model FLOPs are counted for MFU. Frameworks disagree; each is reproduced as its source
/// code computes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(rename_all = "lowercase")]
pub enum FlopsConvention {
    /// ferrotron (default): 6·(matmul params, LM head in, embedding out) + 6·L·s·(a·d) with the
    /// causal halving of the attention term.
    Ferrotron,
    /// torchtitan `get_nparams_and_flops` (torchtitan/models/llama3/model.py): 6·(all params −
    /// the nn.Embedding params) + 12·L·a·d·s; "we follow the convention and do not account for sparsity in
    /// causal attention". A tied LM head is not counted (it is the embedding).
    Torchtitan,
    /// nanotron `get_flops` (nanotron/models/llama.py): 3 × forward matmul FLOPs of q, k, v, o,
    /// the MLP and the LM head, plus QKᵀ and AV over the full s × s square, no biases.
    Nanotron,
    /// Megatron-LM `num_floating_point_operations` (megatron/training/training.py):
    /// 12·s·L·h²·[(1 + g/a + s/h)·(a·d/h) + (f/h)·k·(3/2 if gated) + V/(2·L·h)] per sequence;
    /// for GPT this is Narayanan et al. 2021 eq. (3): 72·B·s·L·h²·(1 + s/(6h) + V/(12hL)).
    Megatron,
    /// The 6ND rule with N = every (active) parameter, embeddings included (Kaplan et al. 2020
    /// §2.1; Hoffmann et al. 2022 count N this way).
    #[serde(rename = "6n")]
    SixN,
}

impl FlopsConvention {
    pub const ALL: [FlopsConvention; 5] = [
        FlopsConvention::Ferrotron,
        FlopsConvention::Torchtitan,
        FlopsConvention::Nanotron,
        FlopsConvention::Megatron,
        FlopsConvention::SixN,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FlopsConvention::Ferrotron => "ferrotron",
            FlopsConvention::Torchtitan => "torchtitan",
            FlopsConvention::Nanotron => "nanotron",
            FlopsConvention::Megatron => "megatron",
            FlopsConvention::SixN => "6n",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            FlopsConvention::Ferrotron => {
                "6·matmul params (LM head in, embedding out) + 6·L·s·a·d (causal)"
            }
            FlopsConvention::Torchtitan => {
                "6·(params − embedding) + 12·L·a·d·s (no causal halving)"
            }
            FlopsConvention::Nanotron => {
                "3 × forward matmuls incl. LM head + full-square attention"
            }
            FlopsConvention::Megatron => {
                "Megatron-LM num_floating_point_operations (Narayanan et al. 2021)"
            }
            FlopsConvention::SixN => "6 × all active parameters, embeddings included",
        }
    }
}

impl FromStr for FlopsConvention {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, PlanError> {
        FlopsConvention::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| {
                PlanError::setting(
                    "flops_convention",
                    s,
                    "expected one of ferrotron, torchtitan, nanotron, megatron, 6n",
                )
            })
    }
}

impl fmt::Display for FlopsConvention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn is_embedding(t: &Tensor) -> bool {
    t.placement == Placement::Embedding
}

/// Model FLOPs per token at sequence length `seq` under a convention.
pub fn flops_per_token(m: &ModelSpec, seq: u64, c: FlopsConvention) -> f64 {
    flops_per_token_with(m, &inventory(m), seq, c)
}

/// As `flops_per_token`, with the model's tensor inventory already built.
pub fn flops_per_token_with(
    m: &ModelSpec,
    tensors: &[Tensor],
    seq: u64,
    c: FlopsConvention,
) -> f64 {
    let p = count(m, tensors);
    // Attention-score width a·d (MLA: a·(d_qk + d_v)/2, see `ModelSpec::score_width`).
    let (l, s, q) = (m.layers as f64, seq as f64, m.score_width());
    // Parameters of the experts a token is not routed to (MoE): excluded from "active".
    let inactive = (p.total - p.active) as f64;
    match c {
        FlopsConvention::Ferrotron => 6.0 * p.matmul_active as f64 + 6.0 * l * s * q,
        FlopsConvention::Torchtitan => {
            let emb: u64 = tensors
                .iter()
                .filter(|t| is_embedding(t))
                .map(Tensor::numel)
                .sum();
            6.0 * (p.total as f64 - inactive - emb as f64) + 12.0 * l * q * s
        }
        FlopsConvention::Nanotron => {
            // Matmul weights (2-D, not the embedding), inactive experts excluded, the LM head
            // counted (tied or not); biases and norms are not matmuls.
            6.0 * p.matmul_active as f64 + 12.0 * l * q * s
        }
        FlopsConvention::Megatron => {
            let h = m.hidden as f64;
            let a = m.heads as f64;
            let g = m.kv_heads as f64;
            // The MLP width a token sees, averaged over the layers: f for a dense layer,
            // top_k × expert width + shared width for a MoE layer (Megatron-LM's
            // `moe_ffn_hidden_size · topk + shared_expert_ffn_hidden_size`, with
            // `moe_layer_freq`'s dense layers at ffn_hidden_size). MLA attention is costed
            // with the GQA term at a = kv heads and a·d = `score_width` (an approximation of
            // Megatron's MLA branch).
            let moe_layers = (0..m.layers).filter(|&i| m.is_moe_layer(i)).count() as f64;
            let moe_width = m.moe.map_or(0.0, |moe| {
                (moe.expert_intermediate * moe.top_k + moe.shared_intermediate) as f64
            });
            let f = (moe_layers * moe_width + (l - moe_layers) * m.intermediate as f64) / l;
            let k = 1.0;
            let gated = if m.mlp_act == MlpAct::Gelu { 1.0 } else { 1.5 };
            let v = m.vocab as f64;
            12.0 * l
                * h
                * h
                * ((1.0 + g / a + s / h) * (q / h) + (f / h) * k * gated + v / (2.0 * l * h))
        }
        FlopsConvention::SixN => 6.0 * p.active as f64,
    }
}

/// Model FLOPs per token under every convention, in `FlopsConvention::ALL` order.
pub fn all_conventions(m: &ModelSpec, seq: u64) -> Vec<(FlopsConvention, f64)> {
    all_conventions_with(m, &inventory(m), seq)
}

/// As `all_conventions`, with the model's tensor inventory already built.
pub fn all_conventions_with(
    m: &ModelSpec,
    tensors: &[Tensor],
    seq: u64,
) -> Vec<(FlopsConvention, f64)> {
    FlopsConvention::ALL
        .into_iter()
        .map(|c| (c, flops_per_token_with(m, tensors, seq, c)))
        .collect()
}
