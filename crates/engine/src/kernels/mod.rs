//! The kernel interface: every op the model needs, forward and backward.
//!
//! The model (`crate::model`) calls only this trait, so a CUDA backend can implement the same
//! trait later without touching the model code. Math is f32 on host slices for now; each op
//! takes a small shape struct so that adding dtypes/strides later extends a struct instead of
//! every signature.
//!
//! Layout conventions (HF Llama / PyTorch):
//! - Linear weights are `[out_features, in_features]` row-major (`nn.Linear`), so `y = x·Wᵀ + b`.
//! - Activations are token-major: `[N, C]` with `N = B·T`; attention q is `[B, T, H, D]`,
//!   k and v are `[B, T, KV, D]`, exactly as the projections produce them.
//! - Backward ops *accumulate* into parameter gradients (gradient accumulation relies on it);
//!   activation gradients take an explicit [`Accum`] flag.

pub mod cpu;
pub mod event_log;
pub mod observe;
pub mod profile;

pub use cpu::CpuKernels;
pub use event_log::{Event, EventLog, Tracing};
pub use observe::{Observed, OpObserver};
pub use profile::{OpTime, OpTotals, Profiled};

/// Whether an op overwrites its output or adds into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accum {
    /// `out = result`
    Overwrite,
    /// `out += result`
    Add,
}

/// `y[n, out] = x[n, in] · W[out, in]ᵀ (+ bias[out])`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulShape {
    /// Rows of x and y (tokens).
    pub n: usize,
    pub in_features: usize,
    pub out_features: usize,
}

/// RMSNorm over rows of length `c`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormShape {
    pub n: usize,
    pub c: usize,
    pub eps: f32,
}

/// A `[B, T, heads, head_dim]` token-major tensor, as RoPE sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeShape {
    pub b: usize,
    pub t: usize,
    pub heads: usize,
    pub head_dim: usize,
}

/// Causal grouped-query attention: q `[B,T,H,D]`, k/v `[B,T,KV,D]`, o `[B,T,H,D]`, lse `[B,H,T]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub b: usize,
    pub t: usize,
    /// Query heads H.
    pub heads: usize,
    /// Key/value heads KV; `heads % kv_heads == 0`, query head h reads kv head `h / (H/KV)`.
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    pub fn q_len(&self) -> usize {
        self.b * self.t * self.heads * self.head_dim
    }
    pub fn kv_len(&self) -> usize {
        self.b * self.t * self.kv_heads * self.head_dim
    }
    pub fn lse_len(&self) -> usize {
        self.b * self.heads * self.t
    }
}

/// Fused softmax + cross-entropy over `rows` rows of `vocab` logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CeShape {
    pub rows: usize,
    pub vocab: usize,
}

/// Target value that contributes neither loss nor gradient (PyTorch's `ignore_index=-100`,
/// stored as u32: any target `>= vocab` is also ignored, so `-100i32 as u32` works too).
pub const IGNORE_INDEX: u32 = u32::MAX;

/// Hyper-parameters of one AdamW step (torch.optim.AdamW semantics).
#[derive(Clone, Copy, Debug, PartialEq)]
/// Scalars are f64 because torch computes them as Python floats before casting to the tensor
/// dtype; keeping them f64 reproduces its rounding.
pub struct AdamWParams {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// 1-based step count used for bias correction.
    pub step: u64,
}

/// Precomputed RoPE cos/sin tables `[max_pos, head_dim/2]` (HF `rotate_half` convention:
/// frequency `i` rotates the pair `(x[i], x[i + D/2])`).
#[derive(Clone, Debug)]
pub struct RopeTable {
    pub head_dim: usize,
    pub max_pos: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    /// `inv_freq[i] = 1 / theta^(2i/D)` and `angle = pos · inv_freq[i]`, both computed in f32 as
    /// HF `LlamaRotaryEmbedding` does (Su et al. 2021, RoFormer eq. 34), then cos/sin rounded
    /// from f64 so the table matches torch's f32 `cos()` to the last ulp or so.
    pub fn new(head_dim: usize, max_pos: usize, theta: f32) -> Self {
        assert!(
            head_dim.is_multiple_of(2),
            "RoPE head_dim must be even, got {head_dim}"
        );
        let half = head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                let expo = (2 * i) as f32 / head_dim as f32;
                1.0f32 / theta.powf(expo)
            })
            .collect();
        let mut cos = vec![0.0f32; max_pos * half];
        let mut sin = vec![0.0f32; max_pos * half];
        for p in 0..max_pos {
            for i in 0..half {
                let angle = (p as f32 * inv_freq[i]) as f64;
                cos[p * half + i] = angle.cos() as f32;
                sin[p * half + i] = angle.sin() as f32;
            }
        }
        Self {
            head_dim,
            max_pos,
            cos,
            sin,
        }
    }
}

/// Every op of a Llama-family training step. All slices are dense, row-major, f32.
///
/// Parameter gradients (`dw`, `dbias`, `dweight`, `dwte`) are always accumulated (`+=`).
pub trait Kernels: Send + Sync {
    // ---- linear layers ----
    /// `y (=|+=) x·Wᵀ + bias`. `y_accum = Add` fuses a residual add (`y` holds the residual).
    fn matmul_forward(
        &self,
        s: MatmulShape,
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        y: &mut [f32],
        y_accum: Accum,
    );
    /// `dx (=|+=) dy·W`, `dW += dyᵀ·x`, `dbias += Σ_rows dy`. `dx = None` skips the input grad.
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward(
        &self,
        s: MatmulShape,
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        dx: Option<(&mut [f32], Accum)>,
        dw: &mut [f32],
        dbias: Option<&mut [f32]>,
    ) {
        self.matmul_backward_weight(s, dy, x, dw, dbias);
        if let Some((dx, acc)) = dx {
            self.matmul_backward_input(s, dy, w, dx, acc);
        }
    }
    /// `dW += dyᵀ·x`, `dbias += Σ_rows dy`.
    fn matmul_backward_weight(
        &self,
        s: MatmulShape,
        dy: &[f32],
        x: &[f32],
        dw: &mut [f32],
        dbias: Option<&mut [f32]>,
    );
    /// `dx (=|+=) dy·W`. Split from the weight grad so that `dx` may reuse `x`'s storage once
    /// the weight grad has consumed it (the fused LM-head does this).
    fn matmul_backward_input(
        &self,
        s: MatmulShape,
        dy: &[f32],
        w: &[f32],
        dx: &mut [f32],
        dx_accum: Accum,
    );

    // ---- RMSNorm (Zhang & Sennrich 2019) ----
    /// `out = x · rstd · w`, `rstd = 1/sqrt(mean(x²) + eps)` saved per row.
    fn rmsnorm_forward(
        &self,
        s: NormShape,
        x: &[f32],
        w: &[f32],
        out: &mut [f32],
        rstd: &mut [f32],
    );
    /// `dx (=|+=) rstd·(dy⊙w − x̂·mean(dy⊙w⊙x̂))`, `dw += Σ_rows dy⊙x̂`, `x̂ = x·rstd`.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self,
        s: NormShape,
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        rstd: &[f32],
        dx: &mut [f32],
        dx_accum: Accum,
        dw: &mut [f32],
    );

    // ---- rotary embeddings ----
    /// Rotate `x` `[B,T,heads,D]` in place; position of token t is t (each sequence from 0).
    fn rope_forward(&self, s: RopeShape, table: &RopeTable, x: &mut [f32]);
    /// Inverse rotation (the rotation is orthogonal, so its transpose is its inverse).
    fn rope_backward(&self, s: RopeShape, table: &RopeTable, dx: &mut [f32]);

    // ---- causal GQA attention, flash style (Dao et al. 2022) ----
    /// `o = softmax(q·kᵀ/√D + causal mask)·v`, saves `lse` `[B,H,T]`; no T×T matrix is stored.
    #[allow(clippy::too_many_arguments)]
    fn attention_forward(
        &self,
        s: AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        o: &mut [f32],
        lse: &mut [f32],
    );
    /// Overwrites dq, dk, dv, recomputing probabilities from q, k and lse.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        s: AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        o: &[f32],
        lse: &[f32],
        d_o: &[f32],
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
    );

    // ---- SwiGLU (Shazeer 2020) ----
    /// `h = silu(gate) ⊙ up`.
    fn swiglu_forward(&self, gate: &[f32], up: &[f32], h: &mut [f32]);
    /// Overwrites `dgate`, `dup` from `dh`.
    fn swiglu_backward(
        &self,
        dh: &[f32],
        gate: &[f32],
        up: &[f32],
        dgate: &mut [f32],
        dup: &mut [f32],
    );

    // ---- token embedding ----
    /// `out[n, :] = wte[tokens[n], :]`.
    fn embedding_forward(&self, tokens: &[u32], wte: &[f32], c: usize, out: &mut [f32]);
    /// `dwte[tokens[n], :] += dout[n, :]`.
    fn embedding_backward(&self, tokens: &[u32], dout: &[f32], c: usize, dwte: &mut [f32]);

    // ---- elementwise ----
    /// `out = a + b`.
    fn add(&self, a: &[f32], b: &[f32], out: &mut [f32]);
    /// `acc += x`.
    fn add_inplace(&self, acc: &mut [f32], x: &[f32]);
    /// `dst = src`.
    fn copy(&self, src: &[f32], dst: &mut [f32]);
    /// `x *= s`.
    fn scale(&self, x: &mut [f32], s: f32);
    /// `Σ x²` accumulated in f64 (global grad norm = sqrt of the sum over all shards).
    fn sum_squares(&self, x: &[f32]) -> f64;

    /// Creates the backend's per-thread runtime state (library caches, workspaces) up front,
    /// so that it is part of a process's fixed baseline rather than appearing mid-step.
    fn warm_up(&self) {}

    // ---- loss ----
    /// Per row: `loss = logsumexp(logits) − logits[target]` written to `losses` (0 for ignored
    /// rows); returns their sum (f64). If `dlogits_scale` is `Some(s)`, overwrites `logits`
    /// with `s·(softmax(logits) − onehot(target))` (zeros for ignored rows).
    fn cross_entropy(
        &self,
        s: CeShape,
        logits: &mut [f32],
        targets: &[u32],
        losses: &mut [f32],
        dlogits_scale: Option<f32>,
    ) -> f64;

    // ---- optimizer ----
    /// One torch.optim.AdamW step over a flat slice (Loshchilov & Hutter 2019, Alg. 2).
    fn adamw_step(
        &self,
        h: AdamWParams,
        params: &mut [f32],
        grads: &[f32],
        m: &mut [f32],
        v: &mut [f32],
    );

    // ---- casts (mixed-precision storage) ----
    fn cast_f32_to_bf16(&self, src: &[f32], dst: &mut [half::bf16]);
    fn cast_bf16_to_f32(&self, src: &[half::bf16], dst: &mut [f32]);
}
