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

use std::fmt;
use std::str::FromStr;

/// Recomputation policy of the training forward/backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Recompute {
    #[default]
    None,
    Selective,
    Full,
}

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

/// Dropped by the selective policy.
pub const SELECTIVE_DROPS: [&str; 3] = ["ln1_out", "ln2_out", "swiglu"];

impl Recompute {
    /// Whether the training forward keeps layer tensor `field` for the backward.
    pub fn keeps(self, field: &str) -> bool {
        match self {
            Recompute::None => true,
            Recompute::Selective => !SELECTIVE_DROPS.contains(&field),
            Recompute::Full => field == "input",
        }
    }

    /// The dropped tensors, in allocation order (the `recompute.*` workspace).
    pub fn dropped(self) -> impl Iterator<Item = &'static str> {
        LAYER_FIELDS.into_iter().filter(move |f| !self.keeps(f))
    }

    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
    }
}

impl fmt::Display for Recompute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Recompute {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Recompute::None),
            "selective" => Ok(Recompute::Selective),
            "full" => Ok(Recompute::Full),
            _ => Err(format!(
                "recompute = {s}: expected one of none, selective, full"
            )),
        }
    }
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
