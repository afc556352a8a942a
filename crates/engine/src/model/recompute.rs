//! Activation recomputation: which of a layer's activations the training forward keeps for the
//! backward, and which it drops and rebuilds during that layer's backward. The definitions are
//! the planner's table (`ferrotron_plan::tensors::LayerTensor::kept_by`, docs/FORMULAS.md):
//!
//! - `None`: all 14 tensors of a layer are kept (`act.layers.{i}.<name>`).
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

pub use ferrotron_plan::tensors::LayerTensor;
pub use ferrotron_plan::Recompute;

/// A layer's tensors (`moe`: with a sparse MLP's router and routed copies) in the order the
/// forward allocates them.
pub fn layer_tensors(moe: bool) -> impl Iterator<Item = LayerTensor> {
    LayerTensor::of_layer(moe)
}

/// The tensors `rc` drops, in allocation order (the `recompute.*` workspace).
pub fn dropped(rc: Recompute, moe: bool) -> impl Iterator<Item = LayerTensor> {
    layer_tensors(moe).filter(move |t| !t.kept_by(rc))
}
