//! Bytes the elementwise kernels of a decoder layer move per element, forward and backward:
//! fused kernels (the ferrotron engine, Megatron's fused kernels) or PyTorch eager, op by op,
//! as torchtitan's Llama runs without `torch.compile` (each op reads its inputs and writes its
//! output in HBM).

use crate::convention::Convention;

/// Bytes per element: (forward, backward).
#[derive(Debug, Clone, Copy)]
pub(super) struct Traffic {
    /// One norm, per element of the residual stream.
    pub(super) norm: (f64, f64),
    /// The gated MLP product, per element of one [tokens, ffn] input.
    pub(super) gated: (f64, f64),
    /// RoPE, per element of q and k.
    pub(super) rope: (f64, f64),
    /// Copies of the attention output, per element of it.
    pub(super) attn_copy: (f64, f64),
}

impl Traffic {
    /// Fused kernels with `st`-byte activations: a norm reads x and writes y (backward reads
    /// x and dy, writes dx); the gated product reads gate and up and writes the product
    /// (backward reads both and the gradient, writes two); RoPE reads and writes q and k.
    fn fused(st: f64) -> Traffic {
        Traffic {
            norm: (2.0 * st, 3.0 * st),
            gated: (3.0 * st, 5.0 * st),
            rope: (2.0 * st, 2.0 * st),
            attn_copy: (0.0, 0.0),
        }
    }

    /// torchtitan's Llama in eager mode with bf16 activations (pytorch/torchtitan at the
    /// 2024-12 benchmark commit 9dec370, `torchtitan/models/norms.py` and
    /// `torchtitan/models/llama/model.py`), counting each op's HBM reads and writes:
    /// - `RMSNorm`: `self._norm(x.float()).type_as(x) * self.weight` with `_norm(x) = x *
    ///   torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`: forward x.float() 2 + 4, pow
    ///   4 + 4, mean 4, x · rsqrt 4 + 4, type_as 4 + 2, · weight 2 + 2 = 36 bytes; backward
    ///   (the autograd of each) · weight 2 + 2 and its weight gradient 2 + 2, type_as 2 + 4,
    ///   x · rsqrt 4 + 4 and its reduction 4 + 4, pow 4 + 4, the sum of both paths 4 + 4 + 4,
    ///   x.float() 4 + 2 = 56 bytes.
    /// - `apply_rotary_emb` on q and k through complex64: .float() 2 + 4, the complex product
    ///   4 + 4, type_as 4 + 2 = 20 bytes each way.
    /// - `w2(F.silu(w1(x)) * w3(x))`: silu 2 + 2 and the product 2 + 2 + 2 = 10 bytes; backward
    ///   the product's two gradients 6 + 6 and silu's 6 = 18.
    /// - `output.transpose(1, 2).contiguous()` after attention: a copy, 2 + 2 each way.
    fn torchtitan_eager() -> Traffic {
        Traffic {
            norm: (36.0, 56.0),
            gated: (10.0, 18.0),
            rope: (20.0, 20.0),
            attn_copy: (4.0, 4.0),
        }
    }

    /// The traffic of a convention's layer with `st`-byte activations (torchtitan's eager
    /// counts are for bf16 activations; other storage is costed fused).
    pub(super) fn of(conv: Convention, st: f64) -> Traffic {
        if conv == Convention::Torchtitan && st == 2.0 {
            Traffic::torchtitan_eager()
        } else {
            Traffic::fused(st)
        }
    }
}
