//! Context parallelism's ring attention, block by block (Liu et al. 2023, "Ring Attention with
//! Blockwise Transformers", arXiv 2310.01889): what one layer's ring exchanges expose, and the
//! extra memory traffic of PyTorch's implementation (`torch.distributed.tensor.experimental.
//! _attention`, the context parallelism torchtitan runs).
//!
//! With causal load balancing each rank holds chunks r and 2·cp − 1 − r of the sequence, so
//! every one of the cp blocks a rank computes (its own causal block, then cp − 1 non-causal
//! half blocks: all of q against the first half of an earlier rank's K/V, or the second half
//! of q against all of a later rank's) is the same work, 1/cp of the layer's attention. Block
//! i's exchange runs under block i's attention, so each exchange is hidden only by 1/cp of the
//! attention, not by all of it.

use super::overlap;

/// How a rank's K/V (and in the backward their gradients) travel around the ring.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(super) enum Rotation {
    /// One send/receive per block, each under one block's attention (ferrotron's engine; in
    /// the backward each block travels with its dK, dV, and one more pass brings them home).
    #[default]
    Ring,
    /// PyTorch's `_AllGatherRotater` (torchtitan's default `context_parallel_rotate_method =
    /// "allgather"` at commit 9dec370): the K/V of all ranks are all-gathered once, launched
    /// before the first (local) block and awaited before the second, so only the first block's
    /// attention hides them. In the backward the K/V are gathered the same way and the fp32
    /// dK, dV accumulators (`accum_dtype = float32` under `convert_to_f32`) pass from rank to
    /// rank after every block (`_AllToAllRotater`), the last pass awaited after the loop.
    AllGather,
}

/// Seconds one layer's ring exchanges add to the critical path, forward and backward, for one
/// micro-batch. `step` is one K/V pass, `blocks` = cp, `attn_f`/`attn_b` the layer's attention
/// forward and backward seconds; `home` passes of dK, dV after the last block (ferrotron: 1).
pub(super) fn exposed(
    rotation: Rotation,
    step: f64,
    blocks: f64,
    attn_f: f64,
    attn_b: f64,
    home: f64,
) -> (f64, f64) {
    let passes = blocks - 1.0;
    let (block_f, block_b) = (attn_f / blocks, attn_b / blocks);
    match rotation {
        Rotation::Ring => (
            passes * overlap::exposed(step, block_f),
            // K/V with their gradients (twice the bytes), then the passes home.
            passes * overlap::exposed(2.0 * step, block_b) + home * step,
        ),
        Rotation::AllGather => {
            let gather = passes * step;
            // fp32 gradients: twice a bf16 K/V pass, cp passes, the last one exposed.
            let grad = 2.0 * step;
            (
                overlap::exposed(gather, block_f),
                overlap::exposed(gather, block_b) + passes * overlap::exposed(grad, block_b) + grad,
            )
        }
    }
}

/// K/V passes' worth of bytes a layer's ring moves per micro-batch (forward passes, backward
/// passes), for the communication table.
pub(super) fn passes(rotation: Rotation, blocks: f64, home: f64) -> (f64, f64) {
    let passes = blocks - 1.0;
    match rotation {
        Rotation::Ring => (passes, 2.0 * passes + home),
        Rotation::AllGather => (passes, passes + 2.0 * blocks),
    }
}

/// Bytes of memory traffic PyTorch's ring attention adds to one layer, forward and backward,
/// beyond the attention kernels (all eager: the ring runs inside the DTensor dispatcher, outside
/// torch.compile's graphs). `out` elements of the attention output on this rank, `kv` elements
/// of the K and V it passes (torchtitan passes them after `repeat_kv`, at the query heads),
/// `st` bytes of a stored element, `blocks` = cp.
///
/// Forward, per block after the first (`_SDPAMerger.step`, `convert_to_f32`): the block output
/// cast to fp32 (read st, write 4), `out − block_out` (read 8, write 4), the product with
/// `sigmoid(block_lse − lse)` (read 4, write 4) and its subtraction from `out` (read 8, write
/// 4): 36 + st bytes per output element; and the `torch.cat` of K and V into the send buffer
/// (read and write st). Once: the first block's cast and the final cast back (4 + st each way).
/// Backward: zeroed fp32 accumulators for dQ, dK, dV (write 4); per block the block's dQ, dK,
/// dV added into them (read 4 + st, write 4), dK, dV concatenated into the fp32 send buffer
/// (read and write 4), K and V concatenated as in the forward (blocks after the first); at the
/// end the casts back (read 4, write st).
pub(super) fn torch_merge_bytes(out: f64, kv: f64, st: f64, blocks: f64) -> (f64, f64) {
    let passes = blocks - 1.0;
    let fwd = passes * ((36.0 + st) * out + 2.0 * st * kv) + 2.0 * (4.0 + st) * out;
    let add = 8.0 + st;
    let bwd = 4.0 * (out + kv)
        + blocks * (add * (out + kv) + 8.0 * kv)
        + passes * 2.0 * st * kv
        + (4.0 + st) * (out + kv);
    (fwd, bwd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_of_one_block_is_free_and_blocks_hide_less_than_the_whole_attention() {
        for r in [Rotation::Ring, Rotation::AllGather] {
            assert_eq!(exposed(r, 1.0, 1.0, 10.0, 25.0, 0.0).0, 0.0);
        }
        // 4 blocks of 1 s each way, 1.5 s per pass: per block 0.5 s outlasts the block's
        // attention, while the whole attention (4 s) would hide all three passes but for the
        // slowdown share.
        let (f, _) = exposed(Rotation::Ring, 1.5, 4.0, 4.0, 10.0, 0.0);
        assert!((f - 3.0 * 0.5).abs() < 1e-12, "{f}");
        assert!(f > overlap::exposed(4.5, 4.0));
        // The all-gather is hidden by the first block only.
        let (g, _) = exposed(Rotation::AllGather, 0.5, 4.0, 4.0, 10.0, 0.0);
        assert!((g - (1.5 - 1.0)).abs() < 1e-12, "{g}");
    }

    #[test]
    fn torch_merge_traffic_grows_with_the_blocks() {
        let (f1, b1) = torch_merge_bytes(1.0, 0.5, 2.0, 2.0);
        let (f8, b8) = torch_merge_bytes(1.0, 0.5, 2.0, 8.0);
        // One merge of 38 bytes per output element and a 2-byte K/V concatenation per pass.
        assert!((f8 - f1 - 6.0 * (38.0 + 2.0)).abs() < 1e-12);
        assert!(b8 > b1);
    }
}
