//! torchtitan's op-level selective activation checkpointing (`activation_checkpoint.mode =
//! "selective"`, `selective_ac_option = "op"`), the `torchtitan` convention's selective
//! recomputation.
//!
//! Source: pytorch/torchtitan `torchtitan/models/llama/parallelize_llama.py` (at the 2024-12
//! benchmark commit 9dec370 and since, now `torchtitan/distributed/activation_checkpoint.py`):
//! each transformer block is checkpointed with a policy that saves the outputs of the ops in its
//! save list (`aten.mm`, the SDPA flash/efficient kernels, `reduce_scatter_tensor`,
//! `aten.max`) "except every second mm", counting the block's mm calls from one
//! (`meta[mm_count_key] % 2 == 0` recomputes); everything else is recomputed in the backward.
//! A Llama block runs its matmuls in the order wq, wk, wv, wo, w1, w3, w2, so it saves the
//! outputs of wq, wv, w1 and w2 and of the attention kernel (output and log-sum-exp), keeps the
//! block's input (the checkpoint's argument), and recomputes wk, wo, w3, the norms, RoPE, the
//! SwiGLU product and the residual adds.

use crate::tensors::LayerTensor;

/// The table's tensors the policy keeps: the block input, wq's and wv's outputs (q is saved
/// before RoPE, the same size), the attention kernel's outputs, w1's output (the gate).
const KEEPS: &[LayerTensor] = &[
    LayerTensor::Input,
    LayerTensor::Q,
    LayerTensor::V,
    LayerTensor::AttnLse,
    LayerTensor::AttnOut,
    LayerTensor::Gate,
];

/// Whether torchtitan's op-level policy keeps a tensor of the table's layer.
pub fn keeps(t: LayerTensor) -> bool {
    KEEPS.contains(&t)
}

/// Name of the one kept tensor the table's layer has no entry for: w2's output, [tokens,
/// hidden] before the residual add.
pub const MLP_OUT: &str = "mlp_out";

/// Whether the policy recomputes the `i`-th (from 0) matmul of a layer's forward: every second
/// one, i.e. the 2nd, 4th, 6th (wk, wo, w3).
pub fn recomputes_matmul(i: usize) -> bool {
    i % 2 == 1
}
