//! Accounting conventions. Tools disagree about what a training step holds; the planner
//! reproduces each published accounting and says which one a figure uses.

use crate::error::PlanError;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Convention {
    /// ferrotron's own engine: a named inventory of every buffer the trainer allocates
    /// (flash attention, chunked fp32 cross-entropy, lazy gradients and optimizer states).
    Ferrotron,
    /// Korthikanti et al. 2022 (arXiv 2205.05198), Table 2 activations and Megatron's
    /// 18 B/param model states (bf16 params, fp32 main grads, fp32 master, Adam).
    Megatron,
    /// Rajbhandari et al. 2020 (ZeRO, arXiv 1910.02054) §3.1/§5: (2 + 2 + K)Ψ with K = 12.
    ZeroPaper,
    /// The Ultra-Scale Playbook (Tazi et al., Hugging Face 2025): 16 B/param (20 with fp32
    /// gradient accumulation) and L·s·b·h·(34 + 5·a·s/h) activations.
    Playbook,
    /// torchtitan (pytorch/torchtitan) on FSDP2: fp32 sharded parameters (the optimizer's),
    /// fp32 gradients (`reduce_dtype` float32), bf16 gathers; the model's own tensors with
    /// SDPA flash attention; full fp32 logits; selective recomputation is its op-level policy
    /// (`sac.rs`).
    Torchtitan,
    /// Megatron-LM's own memory report (`theoretical_memory_usage.py`) on its padded
    /// vocabulary: 18 or 6 + 12/d B/param, s·b·h·(18 + 4f/h)/t per layer with SP + selective
    /// recomputation, else s·b·h·(10 + 24/t) × 1.05 (`megatron_lm.rs`).
    MegatronLm,
    /// DeepSpeed's ZeRO (`deepspeed.rs`): full 16-bit gradients under ZeRO-1/2 plus 16 B/param
    /// over the partition (4Ψ + 16Ψ/N), ZeRO-3 18Ψ/N + 4 × the largest layer, offload as its
    /// estimators, the contiguous-gradients bucket; activations as the playbook.
    DeepSpeed,
}

impl Convention {
    pub const ALL: [Convention; 7] = [
        Convention::Ferrotron,
        Convention::Megatron,
        Convention::ZeroPaper,
        Convention::Playbook,
        Convention::Torchtitan,
        Convention::MegatronLm,
        Convention::DeepSpeed,
    ];

    /// Whether layer activations are the model's own tensors (the tensor table), rather than
    /// a published per-layer formula.
    pub fn tensor_activations(self) -> bool {
        matches!(self, Convention::Ferrotron | Convention::Torchtitan)
    }

    /// Whether attention runs as a fused flash kernel (the frameworks), rather than unfused
    /// over the full score matrix (the formulas of Korthikanti et al., the playbook, ZeRO).
    pub fn fused_attention(self) -> bool {
        self.tensor_activations() || self == Convention::MegatronLm
    }

    /// Whether gradients are fp32 `main_grad` buffers (Megatron).
    pub fn fp32_main_grads(self) -> bool {
        matches!(self, Convention::Megatron | Convention::MegatronLm)
    }

    /// The communication overlaps the framework offers as settings, which `plan search` turns
    /// on wherever a layout allows them (each only shortens the step: `overlap::exposed` never
    /// exceeds the collective, and none changes the memory plan): Megatron-LM's
    /// `--tp-comm-overlap`, `--overlap-param-gather` and `--overlap-p2p-communication`;
    /// torchtitan's async TP (`enable_async_tensor_parallel`). ferrotron's engine and the
    /// formula conventions offer none. (tp, param gather, pp)
    pub fn offered_overlaps(self) -> (bool, bool, bool) {
        match self {
            Convention::MegatronLm => (true, true, true),
            Convention::Torchtitan => (true, false, false),
            _ => (false, false, false),
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Convention::Ferrotron => "ferrotron engine (named buffer inventory, flash attention, chunked CE)",
            Convention::Megatron => "Megatron / Korthikanti et al. 2022, Table 2 (16-bit activations; 18 B/param states)",
            Convention::ZeroPaper => "ZeRO paper, Rajbhandari et al. 2020: (2+2+K)Ψ, K = 12; activations as the playbook",
            Convention::Playbook => "Ultra-Scale Playbook: 16/20 B/param; L·s·b·h·(34 + 5as/h) activations",
            Convention::Torchtitan => "torchtitan on FSDP2: fp32 params and grads, bf16 gathers, SDPA flash attention, fp32 logits, op-level selective checkpointing",
            Convention::DeepSpeed => "DeepSpeed ZeRO: 4Ψ + 16Ψ/N (ZeRO-1/2), 18Ψ/N + 4 × largest layer (ZeRO-3), offload as its estimators, contiguous-gradients bucket; playbook activations",
            Convention::MegatronLm => "Megatron-LM's theoretical memory report: padded vocabulary, 18 or 6 + 12/d B/param, sbh(18 + 4f/h)/t per layer with SP + selective, else sbh(10 + 24/t) × 1.05",
        }
    }
}

impl FromStr for Convention {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, PlanError> {
        Convention::ALL
            .into_iter()
            .find(|c| c.to_string() == s)
            .ok_or_else(|| {
                PlanError::setting(
                    "convention",
                    s,
                    "expected one of ferrotron, megatron, zero-paper, playbook, torchtitan, megatron-lm, deepspeed",
                )
            })
    }
}

impl fmt::Display for Convention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Convention::Ferrotron => "ferrotron",
            Convention::Megatron => "megatron",
            Convention::ZeroPaper => "zero-paper",
            Convention::Playbook => "playbook",
            Convention::Torchtitan => "torchtitan",
            Convention::MegatronLm => "megatron-lm",
            Convention::DeepSpeed => "deepspeed",
        })
    }
}
