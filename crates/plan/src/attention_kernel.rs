//! The attention kernel a framework runs, and how fast it is on each GPU kind, from attention
//! kernel benchmarks only (never from the end-to-end runs the time model is validated on).
//!
//! Sources:
//! - [FA2] T. Dao, "FlashAttention-2", arXiv 2307.08691: abstract, "reaching 50-73% of the
//!   theoretical maximum FLOPs/s on A100" (the range spans causal/non-causal, head dim 64/128,
//!   seq 512–16k, forward and backward; FLOPs counted as the causal half, backward 2.5× the
//!   forward); §4.1: FlashAttention-2 is "around 1.3-1.5× faster than FlashAttention in Triton
//!   in the forward pass and around 2× faster in the backward pass"; on H100 "up to 335
//!   TFLOPs/s".
//! - [FA3] J. Shah et al., "FlashAttention-3", arXiv 2407.08608, abstract: "FlashAttention-2
//!   achieving only 35% utilization on the H100 GPU".

use crate::error::PlanError;
use serde::Serialize;
use std::fmt;
use std::str::FromStr;

/// Which fused attention kernel the training framework runs (the `ferrotron` and framework
/// conventions; the Megatron-style conventions cost attention unfused, as their memory
/// formulas assume).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKernel {
    /// FlashAttention-2 (PyTorch SDPA's flash backend, flash-attn 2.x).
    #[default]
    Flash2,
    /// The Triton flash-attention (`flash_attn_triton`, llm-foundry's `attn_impl: triton`,
    /// its benchmark default until 2024-03).
    Triton,
}

/// [FA2] §4.1: FlashAttention-2 over the Triton kernel, forward and backward (midpoint of
/// "1.3-1.5×"; "around 2×").
const TRITON_SLOWDOWN: (f64, f64) = (1.4, 2.0);

impl AttentionKernel {
    pub const ALL: [AttentionKernel; 2] = [AttentionKernel::Flash2, AttentionKernel::Triton];

    pub fn name(self) -> &'static str {
        match self {
            AttentionKernel::Flash2 => "flash2",
            AttentionKernel::Triton => "triton",
        }
    }

    /// FlashAttention-2's forward + backward fraction of the bf16 peak on a built-in GPU kind:
    /// A100 the midpoint of [FA2]'s 50–73%, H100/H200 (same SMs and clocks) [FA3]'s 35% (H100
    /// PCIe: the same kernel, assumed); `None` where no benchmark was found (B200, MI300X,
    /// L40S, RTX 4090: the matmul efficiency is used instead).
    pub fn flash2_fraction(gpu: &str) -> Option<f64> {
        match gpu {
            "a100-40" | "a100-80" => Some(0.615),
            "h100" | "h100-96" | "h100-pcie" | "h200" => Some(0.35),
            _ => None,
        }
    }

    /// This kernel's forward and backward throughput relative to FlashAttention-2's.
    pub fn relative_to_flash2(self) -> (f64, f64) {
        match self {
            AttentionKernel::Flash2 => (1.0, 1.0),
            AttentionKernel::Triton => (1.0 / TRITON_SLOWDOWN.0, 1.0 / TRITON_SLOWDOWN.1),
        }
    }
}

impl FromStr for AttentionKernel {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, PlanError> {
        AttentionKernel::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| PlanError::setting("attention", s, "expected one of flash2, triton"))
    }
}

impl fmt::Display for AttentionKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
