//! Activation recomputation: which of a layer's activations the training forward keeps for the
//! backward, and which it drops and rebuilds during that layer's backward. The definitions are
//! the planner's (`ferrotron_plan::activations::llama_layer`, docs/FORMULAS.md):
//!
//! - `None`: all 14 tensors of [`LAYER_FIELDS`] are kept (`act.layers.{i}.<name>`).
//! - `Selective`: `ln1_out`, `ln2_out` and `swiglu` are dropped (cheap to rebuild, large): the
//!   two RMSNorm outputs are recomputed from the kept `input` / `resid_mid` (the norm kernel
//!   rewrites the kept `ln*_rstd` with the identical value), and `swiglu` from the kept
//!   `gate` and `up`. No matmul is replayed.
//! - `Full`: only `input` is kept; the layer's forward (everything but its output projection
//!   into the residual stream) is replayed in its backward.
//!
//! A dropped tensor lives in the workspace buffer `recompute.<name>`: during the forward it
//! holds the tensor until the layer's output exists, and during the backward it is allocated
//! when the layer's backward starts and freed when the backward has consumed it. One set of
//! these buffers serves every layer, one layer at a time. Rebuilding uses the forward's kernels
//! on the same inputs in the same order, so it reproduces the forward's values bit for bit.

pub use ferrotron_plan::Recompute;

/// A layer's activations in the order the forward allocates them.
pub const LAYER_FIELDS: [&str; 14] = [
    "input",
    "ln1_rstd",
    "ln1_out",
    "q",
    "k",
    "v",
    "attn_lse",
    "attn_out",
    "resid_mid",
    "ln2_rstd",
    "ln2_out",
    "gate",
    "up",
    "swiglu",
];

/// The tensors `rc` drops, in allocation order (the `recompute.*` workspace).
pub fn dropped(rc: Recompute) -> impl Iterator<Item = &'static str> {
    LAYER_FIELDS.into_iter().filter(move |f| !rc.keeps(f))
}

/// The workspace buffer name of a dropped layer tensor.
pub fn workspace_name(field: &str) -> &'static str {
    match field {
        "input" => "recompute.input",
        "ln1_rstd" => "recompute.ln1_rstd",
        "ln1_out" => "recompute.ln1_out",
        "q" => "recompute.q",
        "k" => "recompute.k",
        "v" => "recompute.v",
        "attn_lse" => "recompute.attn_lse",
        "attn_out" => "recompute.attn_out",
        "resid_mid" => "recompute.resid_mid",
        "ln2_rstd" => "recompute.ln2_rstd",
        "ln2_out" => "recompute.ln2_out",
        "gate" => "recompute.gate",
        "up" => "recompute.up",
        "swiglu" => "recompute.swiglu",
        _ => panic!("no layer tensor `{field}`"),
    }
}
