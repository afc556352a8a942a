//! Model FLOPs (for MFU) and hardware FLOPs (for HFU).
//!
//! Convention (the default of docs/FORMULAS.md): a matmul of an [n, k] by [k, m] costs 2nkm
//! FLOPs; backward costs twice the forward. Per token of a sequence of length s:
//! - weights: 6 · (matmul parameters used by the token, the LM head included, the embedding
//!   lookup excluded) (Kaplan et al. 2020, §2.1: C ≈ 6N per token);
//! - attention scores and values: forward 2·2·s·(a·d) per layer for the full square, halved for
//!   the causal mask, so 6·L·s·(a·d) forward + backward per token (PaLM, Chowdhery et al. 2022,
//!   App. B, gives 12·L·h·s without the causal halving).

use crate::inventory::{count, inventory};
use crate::model::ModelSpec;

/// Model FLOPs per token at sequence length `seq`, causal attention.
pub fn model_flops_per_token(m: &ModelSpec, seq: u64) -> f64 {
    let p = count(m, &inventory(m));
    6.0 * p.matmul_active as f64 + 6.0 * (m.layers * seq * m.q_dim()) as f64
}

/// Forward FLOPs per token (a third of the model FLOPs), used to add recomputation to HFU.
pub fn forward_flops_per_token(m: &ModelSpec, seq: u64) -> f64 {
    model_flops_per_token(m, seq) / 3.0
}
