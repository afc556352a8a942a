//! The `deepspeed` convention: what DeepSpeed's ZeRO keeps on the GPU, from its source and its
//! memory estimators (microsoft/DeepSpeed, `docs/code-docs/source/memory.rst` at commit
//! 077e6740178eba4ccff1b3ea9a7981578d3d42e4, "Memory Requirements"; `deepspeed/runtime/zero/
//! stage_1_and_2.py`, `DeepSpeedZeroOptimizer.backward`):
//!
//! - 16-bit parameters, partitioned only by ZeRO-3; 16-bit gradients of the whole model under
//!   ZeRO-1/2 (the estimator's "4 params": 2 bytes of parameters and 2 of gradients), none kept
//!   by ZeRO-3 beyond the gathered layer's;
//! - per partition: fp32 parameters, fp32 gradients ("all of them are converted into fp32
//!   before doing the weight updates"), Adam's two moments — 16 bytes over the partition: ZeRO-2
//!   4Ψ + 16Ψ/N, ZeRO-3 18Ψ/N (with the 16-bit parameter partition);
//! - ZeRO-3 gathers the largest layer's 16-bit parameters and computes its 16-bit gradients at
//!   once: 4 × largest layer ("largest_layer_memory = 4*largest_layer_params");
//! - `cpu_offload` (`--offload optimizer`) moves the fp32 states and gradients to the host
//!   (ZeRO-2: 2Ψ on the GPU, ZeRO-3: 2Ψ/N), `cpu_offload_params` (`--offload params`) the
//!   16-bit parameters too;
//! - with `contiguous_gradients` (default on) ZeRO-1/2's `backward` allocates an "ipg" bucket of
//!   `reduce_bucket_size` elements in the 16-bit dtype (default 5e8: 1 GB in bf16), a second one
//!   with `overlap_comm` (default off); ZeRO-3's buckets are not modelled.
//!
//! Activations follow the playbook's formula, as the `zero-paper` convention's do.

/// `reduce_bucket_size`'s default, in elements (`ZERO_OPTIMIZATION_REDUCE_BUCKET_SIZE_DEFAULT`).
pub const REDUCE_BUCKET_ELEMS: u64 = 500_000_000;
