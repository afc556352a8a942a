//! What the kernel interface's ops take besides their buffers: the shape of each op
//! ([`MatmulShape`], [`AttnShape`], [`RouteShape`], …), the layouts several backends must agree
//! on (a mixture of experts' routed rows, [`routed_rows`]; a context-parallel rank's tokens,
//! [`SeqPart`]), the optimizer's hyper-parameters, the RoPE tables, and what a backend can run
//! ([`Limits`]). The ops themselves are listed in `interface.rs`.

/// Gradients, each with its weight, for [`Kernels::sum_squares_weighted`]: drawn one at a
/// time, so a norm over many tensors allocates nothing.
///
/// [`Kernels::sum_squares_weighted`]: super::Kernels::sum_squares_weighted
pub struct Weighted<'a, 'b, G> {
    parts: &'a mut dyn Iterator<Item = (super::View<'b, G>, f64)>,
    /// What each view is made into before it is handed out (an emulated device's views
    /// re-tagged as the host memory they are, `device_check.rs`), and the op's name for it.
    retag: Option<Retag<'b, G>>,
}

/// A view made into another for op `.1` (`Weighted`'s re-tagging).
type Retag<'b, G> = (
    fn(super::View<'b, G>, &'static str) -> super::View<'b, G>,
    &'static str,
);

impl<'a, 'b, G> Weighted<'a, 'b, G> {
    pub fn new(parts: &'a mut dyn Iterator<Item = (super::View<'b, G>, f64)>) -> Self {
        Weighted { parts, retag: None }
    }

    /// Each view handed out through `f` (for op `op`).
    pub fn retagged(self, f: Retag<'b, G>) -> Self {
        Weighted {
            retag: Some(f),
            ..self
        }
    }
}

impl<'b, G> Iterator for Weighted<'_, 'b, G> {
    type Item = (super::View<'b, G>, f64);
    fn next(&mut self) -> Option<Self::Item> {
        let (x, w) = self.parts.next()?;
        Some(match self.retag {
            Some((f, op)) => (f(x, op), w),
            None => (x, w),
        })
    }
}

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
    /// The row count changes from call to call (a mixture of experts' rows per expert): a
    /// backend that compiles a kernel per shape runs such a product as pieces of a few fixed
    /// shapes instead of compiling one for every count.
    pub ragged: bool,
}

/// RMSNorm over rows of length `c`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormShape {
    pub n: usize,
    pub c: usize,
    pub eps: f32,
}

/// A MoE layer's routing: `tokens` tokens each sent to `top_k` of `experts` experts; routed
/// rows (grouped by expert) and token rows are `width` wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteShape {
    pub tokens: usize,
    pub experts: usize,
    pub top_k: usize,
    pub width: usize,
    /// Renormalise the chosen probabilities to sum to 1 (Mixtral).
    pub norm_topk: bool,
    /// The most copies each expert takes from these tokens (a capacity factor's
    /// ⌈cf · tokens · top_k / experts⌉, Fedus et al. 2021 §2.1); the copies past it, in token
    /// order, are dropped ([`DROPPED`]). `None`: exact routing, nothing dropped.
    pub capacity: Option<usize>,
}

/// Marks a routed copy its expert had no room for (see [`RouteShape::capacity`]): the
/// router's choice stays in the low bits (its probability still counts in the renormalised
/// weights and in their gradient), but the copy is no expert's row ([`routed_rows`] skips it),
/// so it adds nothing to its token's output, as Switch Transformer and Megatron-Core drop
/// tokens over capacity.
pub const DROPPED: u32 = 1 << 31;

/// The layout of a MoE layer's routed rows, for every backend: copy `c = n·k + j` (token n's
/// j-th choice) has row `r`, the rows grouped by expert (expert 0's first), each expert's in
/// ascending `c`; a [`DROPPED`] copy has none. Yields `(r, c)` in row order. A pure function of the router's choices, so
/// forward and backward find the same row for a copy without storing a permutation.
pub fn routed_rows(index: &[u32], experts: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
    (0..experts as u32)
        .flat_map(move |e| {
            index
                .iter()
                .enumerate()
                .filter(move |&(_, &x)| x == e)
                .map(|(c, _)| c)
        })
        .enumerate()
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

/// Attention of new tokens against a KV cache (inference decoding, Pope et al. 2022,
/// "Efficiently Scaling Transformer Inference" §2): `attn.t` new queries q `[B, t, H, D]` at
/// positions `pos..pos + t` of their sequences, over the keys and values of positions
/// `0..pos + t`, which the cache k/v `[B, capacity, KV, D]` holds in its first rows (the new
/// tokens' already written). Query `i` sees the keys of positions `≤ pos + i`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedAttnShape {
    /// `attn.t`: the new tokens.
    pub attn: AttnShape,
    /// Position of the first new token (tokens already in the cache).
    pub pos: usize,
    /// Positions the cache has room for.
    pub capacity: usize,
}

impl CachedAttnShape {
    pub fn cache_len(&self) -> usize {
        self.attn.b * self.capacity * self.attn.kv_heads * self.attn.head_dim
    }
}

/// Which tokens of a sequence a rank holds under context parallelism's load-balanced split
/// (the "zigzag" of Megatron-LM's context parallelism and of Llama 3's, Dubey et al. 2024
/// §3.3.2): a sequence of `T` tokens is cut into `2·ranks` chunks and rank `r` holds chunks
/// `r` and `2·ranks − 1 − r`, in that order, so that every rank gets the same share of the
/// causal triangle. One rank (`ranks == 1`) holds the sequence as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqPart {
    pub rank: usize,
    pub ranks: usize,
}

impl SeqPart {
    /// The whole sequence, on one rank.
    pub const WHOLE: SeqPart = SeqPart { rank: 0, ranks: 1 };

    /// Tokens each rank holds of a sequence of `seq`: refused unless the sequence cuts into
    /// `2·ranks` equal chunks.
    pub fn local_len(&self, seq: usize) -> Result<usize, String> {
        let chunks = 2 * self.ranks;
        match self.ranks == 1 || seq.is_multiple_of(chunks) {
            true => Ok(seq / self.ranks),
            false => Err(format!(
                "seq = {seq}: context parallelism over cp = {} cuts each sequence into 2·cp = {chunks} equal chunks; use a multiple of {chunks}",
                self.ranks
            )),
        }
    }

    /// The position in its sequence of local token `i` of a rank holding `t` tokens (`t`
    /// even when the sequence is split).
    #[inline]
    pub fn position(&self, i: usize, t: usize) -> usize {
        if self.ranks == 1 {
            return i;
        }
        let c = t / 2;
        match i < c {
            true => self.rank * c + i,
            false => (2 * self.ranks - 1 - self.rank) * c + (i - c),
        }
    }
}

/// One step of ring attention (context parallelism): this rank's queries `[B,T,H,D]` (tokens
/// `q` of the split) against a key/value block `[B,T,KV,D]` of the same length holding tokens
/// `kv`; a key is visible to a query when its position is not after the query's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingShape {
    pub attn: AttnShape,
    pub q: SeqPart,
    pub kv: SeqPart,
}

/// Fused softmax + cross-entropy over `rows` rows of `vocab` logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CeShape {
    pub rows: usize,
    pub vocab: usize,
}

/// A vocabulary-parallel cross-entropy chunk on one rank: `rows` rows of this rank's `vocab`
/// logits, columns `first..first + vocab` of the model's `full_vocab`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CeShardShape {
    pub rows: usize,
    pub vocab: usize,
    pub first: usize,
    pub full_vocab: usize,
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
    /// Multiplies every gradient as it is read: 1/loss scale times the clipping coefficient
    /// (1 for plain training), so 16-bit gradients are never rescaled in place.
    pub grad_scale: f32,
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

/// How a kernel rounds f32 results into 16-bit parameter storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Rounding {
    /// Round to nearest, ties to even.
    #[default]
    Nearest,
    /// Stochastic rounding; element `i` of optimizer step `t` uses the counter-based noise
    /// `numerics::rounding::noise(seed, t, i)`, so the result does not depend on threading and
    /// a resumed run reproduces it.
    Stochastic { seed: u64 },
}

/// What a backend can run, so that a model is checked against the backend chosen for it
/// before any op runs (a kernel's own assertion would only stop the run mid-step).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The backend's name in error messages ("CPU").
    pub backend: &'static str,
    /// Largest attention `head_dim`.
    pub max_head_dim: usize,
    /// Whether it has the mixture-of-experts ops (router, permute, …).
    pub experts: bool,
}
