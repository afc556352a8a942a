//! The kernel interface itself: the list of every op ([`kernel_interface!`]), the [`Kernels`]
//! trait generated from it, and the generator of forwarding wrappers. The types the ops take
//! are in `shapes.rs`.

use super::*;
/// The kernel interface, listed once: every method of [`Kernels`] with its signature and docs.
/// It expands to `$emit! { hooks { .. } ops { .. } }`, handing the list to a macro that
/// generates code from it. [`Kernels`] itself is generated this way (`kernels_trait!` below),
/// and so is every wrapper backend that forwards each method to an inner backend
/// ([`observe::Observed`]); a backend that implements the ops itself (CPU, a future CUDA)
/// writes its `impl Kernels` by hand. So each signature is written here and once per backend,
/// and changing an argument type is one edit here plus the backends that implement it.
///
/// The two sections tell generators how to forward a method:
/// - `hooks`: backend housekeeping and properties, not kernels; a wrapper forwards them as
///   they are, unobserved. A hook may have a default body.
/// - `ops`: the kernels, which a wrapper observes under the op's name (traces and profiles
///   key on these names). An op with a default body is a composite of other ops; a wrapper
///   keeps the default, so that it observes the parts.
///
/// Entries are plain trait-method syntax with `&self` first, ending in `;` or a default body.
macro_rules! kernel_interface {
    ($emit:ident) => {
        $emit! {
            hooks {
                /// Creates the backend's per-thread runtime state (library caches, workspaces)
                /// up front, so that it is part of a process's fixed baseline rather than
                /// appearing mid-step.
                fn warm_up(&self) {}
                /// Waits until every op issued so far has finished (a GPU runs them
                /// asynchronously; the CPU's have finished when they return), so that a host
                /// timer read after it times the work.
                fn synchronize(&self) {}
                /// The loss sum this backend kept on the device since the last call (its
                /// `cross_entropy` returned 0 for it, issue #32: no host round trip per loss
                /// chunk), read back now: one host synchronisation, or none where the last
                /// gradient norm brought it along. 0 on a backend that returns it at once (the
                /// CPU). The trainer adds it to its micro-batches' sums before it reads the
                /// step's loss.
                fn take_loss(&self) -> f64 {
                    0.0
                }
                /// The host's copy of the ids in `ids`, which the caller has just written
                /// there (a micro-batch's tokens or targets, which come from the host) or read
                /// from there (a router's choices): a backend that would read them back (a
                /// GPU's embedding backward groups positions by token; the target count; a
                /// mixture of experts' routing tables) takes this copy instead, with no host
                /// synchronisation (issue #32). Views inside `ids` are found by address; the
                /// copy holds until `ids` is written again, by the caller (who announces the
                /// new ids the same way) or by the backend's own kernels (the router's, which
                /// drop it). Nothing on a backend whose ids are host memory already (the CPU).
                fn host_ids(&self, ids: View<'_, u32>, host: &[u32]) {
                    let _ = (ids, host);
                }
                /// Tracing: op `op` is about to be called. `true` where this backend times its
                /// ops on the device itself (a GPU, by an event recorded before and after
                /// each: issue #32), so the caller need not drain the device around the op to
                /// time it; `false` (the default) where it does not.
                fn op_begin(&self, op: &'static str) -> bool {
                    let _ = op;
                    false
                }
                /// The op [`Kernels::op_begin`] announced has been called.
                fn op_end(&self) {}
                /// The device's own times of the ops announced since the last call, in order
                /// (waiting for them to finish): each one's start after the first one's start,
                /// and its length. Nothing on a backend that does not time them.
                fn take_device_spans(&self, out: &mut Vec<DeviceSpan>) {
                    let _ = out;
                }
                /// What this backend supports (see [`LlamaConfig::check_backend`]).
                ///
                /// [`LlamaConfig::check_backend`]: crate::model::LlamaConfig::check_backend
                fn limits(&self) -> Limits;
            }
            ops {
                // ---- linear layers ----
                /// `y (=|+=) x·Wᵀ + bias`. `y_accum = Add` fuses a residual add (`y` holds the
                /// residual).
                fn matmul_forward(
                    &self,
                    s: MatmulShape,
                    x: View<'_, S>,
                    w: View<'_, S>,
                    bias: Option<View<'_, S>>,
                    y: ViewMut<'_, S>,
                    y_accum: Accum,
                );
                /// `dx (=|+=) dy·W`, `dW += dyᵀ·x`, `dbias += Σ_rows dy`. `dx = None` skips the
                /// input grad.
                #[allow(clippy::too_many_arguments)]
                fn matmul_backward(
                    &self,
                    s: MatmulShape,
                    dy: View<'_, S>,
                    x: View<'_, S>,
                    w: View<'_, S>,
                    dx: Option<(ViewMut<'_, S>, Accum)>,
                    dw: ViewMut<'_, G>,
                    dbias: Option<ViewMut<'_, G>>,
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
                    dy: View<'_, S>,
                    x: View<'_, S>,
                    dw: ViewMut<'_, G>,
                    dbias: Option<ViewMut<'_, G>>,
                );
                /// `dx (=|+=) dy·W`. Split from the weight grad so that `dx` may reuse `x`'s
                /// storage once the weight grad has consumed it (the fused LM-head does this).
                fn matmul_backward_input(
                    &self,
                    s: MatmulShape,
                    dy: View<'_, S>,
                    w: View<'_, S>,
                    dx: ViewMut<'_, S>,
                    dx_accum: Accum,
                );

                // ---- the LM head: f32 logits (and their gradient), and never fp8 GEMM inputs ----
                /// `logits = x·Wᵀ`.
                fn head_forward(&self, s: MatmulShape, x: View<'_, S>, w: View<'_, S>, logits: ViewMut<'_, f32>);
                /// `dW += dlogitsᵀ·x`.
                fn head_backward_weight(
                    &self,
                    s: MatmulShape,
                    dlogits: View<'_, f32>,
                    x: View<'_, S>,
                    dw: ViewMut<'_, G>,
                );
                /// `dx = dlogits·W`.
                fn head_backward_input(
                    &self,
                    s: MatmulShape,
                    dlogits: View<'_, f32>,
                    w: View<'_, S>,
                    dx: ViewMut<'_, S>,
                );

                // ---- RMSNorm (Zhang & Sennrich 2019) ----
                /// `out = x · rstd · w`, `rstd = 1/sqrt(mean(x²) + eps)` saved per row.
                fn rmsnorm_forward(
                    &self,
                    s: NormShape,
                    x: View<'_, S>,
                    w: View<'_, S>,
                    out: ViewMut<'_, S>,
                    rstd: ViewMut<'_, f32>,
                );
                /// `resid += x`, then [`Kernels::rmsnorm_forward`] of the sum: a residual add
                /// and the norm that reads it in one op (issue #32), `resid`'s bits those of
                /// `add_inplace`, `out` and `rstd` those of the norm after it (a GPU reads and
                /// writes each row once instead of twice).
                fn add_rmsnorm_forward(
                    &self,
                    s: NormShape,
                    resid: ViewMut<'_, S>,
                    x: View<'_, S>,
                    w: View<'_, S>,
                    out: ViewMut<'_, S>,
                    rstd: ViewMut<'_, f32>,
                );
                /// `dx (=|+=) rstd·(dy⊙w − x̂·mean(dy⊙w⊙x̂))`, `dw += Σ_rows dy⊙x̂`, `x̂ = x·rstd`.
                #[allow(clippy::too_many_arguments)]
                fn rmsnorm_backward(
                    &self,
                    s: NormShape,
                    dy: View<'_, S>,
                    x: View<'_, S>,
                    w: View<'_, S>,
                    rstd: View<'_, f32>,
                    dx: ViewMut<'_, S>,
                    dx_accum: Accum,
                    dw: ViewMut<'_, G>,
                );

                // ---- rotary embeddings ----
                /// Rotate `x` `[B,T,heads,D]` in place; position of token t is t (each sequence
                /// from 0).
                fn rope_forward(&self, s: RopeShape, table: &RopeTable, x: ViewMut<'_, S>);
                /// Inverse rotation (the rotation is orthogonal, so its transpose is its
                /// inverse).
                fn rope_backward(&self, s: RopeShape, table: &RopeTable, dx: ViewMut<'_, S>);

                // ---- causal GQA attention, flash style (Dao et al. 2022) ----
                /// `o = softmax(q·kᵀ/√D + causal mask)·v`, saves `lse` `[B,H,T]`; no T×T matrix
                /// is stored.
                fn attention_forward(
                    &self,
                    s: AttnShape,
                    q: View<'_, S>,
                    k: View<'_, S>,
                    v: View<'_, S>,
                    o: ViewMut<'_, S>,
                    lse: ViewMut<'_, f32>,
                );
                /// Overwrites dq, dk, dv, recomputing probabilities from q, k and lse.
                #[allow(clippy::too_many_arguments)]
                fn attention_backward(
                    &self,
                    s: AttnShape,
                    q: View<'_, S>,
                    k: View<'_, S>,
                    v: View<'_, S>,
                    o: View<'_, S>,
                    lse: View<'_, f32>,
                    d_o: View<'_, S>,
                    dq: ViewMut<'_, S>,
                    dk: ViewMut<'_, S>,
                    dv: ViewMut<'_, S>,
                );

                /// Causal GQA attention of new tokens over a KV cache ([`CachedAttnShape`]):
                /// writes `o` `[B, t, H, D]`; saves no `lse` (inference has no backward).
                fn attention_forward_cached(
                    &self,
                    s: CachedAttnShape,
                    q: View<'_, S>,
                    k_cache: View<'_, S>,
                    v_cache: View<'_, S>,
                    o: ViewMut<'_, S>,
                );

                /// One step of ring attention (Liu et al. 2023; `s` says which tokens the queries
                /// and the block are): this rank's queries against a key/value block received
                /// in f32, merged into the running output `o` (f32, normalised) and `lse` by
                /// their log-sum-exp, as the online softmax merges tiles (Dao 2023). With
                /// `first` the running values are overwritten. A query that sees no key of the
                /// block keeps its values.
                #[allow(clippy::too_many_arguments)]
                fn attention_forward_ring(
                    &self,
                    s: RingShape,
                    q: View<'_, S>,
                    k: View<'_, f32>,
                    v: View<'_, f32>,
                    o: ViewMut<'_, f32>,
                    lse: ViewMut<'_, f32>,
                    first: bool,
                );
                /// The block's part of the attention gradient, from the final `o` and `lse`
                /// (of every block): adds into `dq` (this rank's queries) and into `dk`, `dv`
                /// (the block's, which travel the ring with it), all f32.
                #[allow(clippy::too_many_arguments)]
                fn attention_backward_ring(
                    &self,
                    s: RingShape,
                    q: View<'_, S>,
                    k: View<'_, f32>,
                    v: View<'_, f32>,
                    o: View<'_, S>,
                    lse: View<'_, f32>,
                    d_o: View<'_, S>,
                    dq: ViewMut<'_, f32>,
                    dk: ViewMut<'_, f32>,
                    dv: ViewMut<'_, f32>,
                );

                // ---- SwiGLU (Shazeer 2020) ----
                /// `h = silu(gate) ⊙ up`.
                fn swiglu_forward(&self, gate: View<'_, S>, up: View<'_, S>, h: ViewMut<'_, S>);
                /// Overwrites `dgate`, `dup` from `dh`.
                fn swiglu_backward(
                    &self,
                    dh: View<'_, S>,
                    gate: View<'_, S>,
                    up: View<'_, S>,
                    dgate: ViewMut<'_, S>,
                    dup: ViewMut<'_, S>,
                );

                // ---- mixture-of-experts routing (see `cpu/moe_routing.rs`) ----
                /// Softmax, top-k and (`s.norm_topk`) renormalised weights per token;
                /// accumulates Σp and the routed counts per expert into `load` `[2E]`.
                fn router_forward(
                    &self,
                    s: RouteShape,
                    logits: View<'_, f32>,
                    weights: ViewMut<'_, f32>,
                    index: ViewMut<'_, u32>,
                    load: ViewMut<'_, f32>,
                );
                /// Overwrites `dlogits` from `dweights` and the load-balancing loss's
                /// gradient per probability `aux_dp` `[E]`.
                fn router_backward(
                    &self,
                    s: RouteShape,
                    logits: View<'_, f32>,
                    index: View<'_, u32>,
                    dweights: View<'_, f32>,
                    aux_dp: View<'_, f32>,
                    dlogits: ViewMut<'_, f32>,
                );
                /// The token copies grouped by expert: `rows[row] = x[token]`.
                fn permute(&self, s: RouteShape, index: View<'_, u32>, x: View<'_, S>, rows: ViewMut<'_, S>);
                /// `y[token] (=|+=) Σ_j weight_j·rows[row_j]` (weights of 1 without).
                fn unpermute(
                    &self,
                    s: RouteShape,
                    index: View<'_, u32>,
                    weights: Option<View<'_, f32>>,
                    rows: View<'_, S>,
                    y: ViewMut<'_, S>,
                    accum: Accum,
                );
                /// `rows[row_c] *= weights[c]`.
                fn scale_rows(&self, s: RouteShape, index: View<'_, u32>, weights: View<'_, f32>, rows: ViewMut<'_, S>);
                /// `out[c] = ⟨a[row_c], b[row_c]⟩`.
                fn row_dot(&self, s: RouteShape, index: View<'_, u32>, a: View<'_, S>, b: View<'_, S>, out: ViewMut<'_, f32>);
                /// `rows[r] = values[c]` for each routed row r and the copy c it holds: every
                /// routed copy's value (its routing weight) in row order.
                fn gather_copies(&self, s: RouteShape, index: View<'_, u32>, values: View<'_, f32>, rows: ViewMut<'_, f32>);
                /// The inverse: `values[c] = rows[r]` (a dropped copy's entry is left as it was).
                fn scatter_copies(&self, s: RouteShape, index: View<'_, u32>, rows: View<'_, f32>, values: ViewMut<'_, f32>);
                /// `rows[r] *= weights[r]` for rows of `width` in order, each product rounded
                /// once ([`Kernels::scale_rows`] without the routing: expert parallelism's
                /// rows arrive with their weights).
                fn scale_each_row(&self, width: usize, weights: View<'_, f32>, rows: ViewMut<'_, S>);
                /// `out[r] = ⟨a[r], b[r]⟩` in f32 for rows of `width` in order
                /// ([`Kernels::row_dot`] without the routing).
                fn dot_each_row(&self, width: usize, a: View<'_, S>, b: View<'_, S>, out: ViewMut<'_, f32>);

                // ---- token embedding ----
                /// `out[n, :] = wte[tokens[n], :]`.
                fn embedding_forward(&self, tokens: View<'_, u32>, wte: View<'_, S>, c: usize, out: ViewMut<'_, S>);
                /// `dwte[tokens[n], :] += dout[n, :]` (a token's rows are summed in f32 first).
                fn embedding_backward(&self, tokens: View<'_, u32>, dout: View<'_, S>, c: usize, dwte: ViewMut<'_, G>);
                /// Vocabulary-parallel embedding (Shoeybi et al. 2019 §3): `wte` holds rows
                /// `first..` of the table; a token outside them gets a zero row (the tensor-
                /// parallel group's all-reduce fills it in).
                fn embedding_forward_shard(
                    &self,
                    tokens: View<'_, u32>,
                    wte: View<'_, S>,
                    c: usize,
                    first: usize,
                    out: ViewMut<'_, S>,
                );
                /// `dwte[t − first, :] += dout[n, :]` for the tokens `t` of this shard.
                fn embedding_backward_shard(
                    &self,
                    tokens: View<'_, u32>,
                    dout: View<'_, S>,
                    c: usize,
                    first: usize,
                    dwte: ViewMut<'_, G>,
                );

                // ---- elementwise ----
                /// `out = a + b`.
                fn add(&self, a: View<'_, S>, b: View<'_, S>, out: ViewMut<'_, S>);
                /// `acc += x`.
                fn add_inplace(&self, acc: ViewMut<'_, S>, x: View<'_, S>);
                /// `dst = src`.
                fn copy(&self, src: View<'_, S>, dst: ViewMut<'_, S>);
                /// `x *= s` over gradients.
                fn scale(&self, x: ViewMut<'_, G>, s: f32);
                /// `Σ x²` over gradients, accumulated in f64 (global grad norm = sqrt of the sum
                /// over all shards); inf or NaN if any element is (the loss scaler's overflow
                /// check).
                fn sum_squares(&self, x: View<'_, G>) -> f64;
                /// `Σ w·Σ x²` over `parts` (gradients, each with its weight): a norm over many
                /// tensors, some counted in part (a replicated norm's share of a
                /// tensor-parallel group), read back once where a device keeps the sums (one
                /// host synchronisation for the lot, not one a tensor). Inf or NaN if any
                /// element is.
                fn sum_squares_weighted(&self, parts: Weighted<'_, '_, G>) -> f64;
                /// `dst = round(src)`: parameters from the fp32 master weights.
                fn round_params(&self, src: View<'_, f32>, dst: ViewMut<'_, S>);
                /// `dst = src` widened to f32, exactly: activations into an f32 block
                /// (context parallelism's ring).
                fn widen(&self, src: View<'_, S>, dst: ViewMut<'_, f32>);
                /// `dst = src` rounded to the storage type, to nearest even: an f32 block's
                /// results into activations (the ring's output and gradients).
                fn narrow(&self, src: View<'_, f32>, dst: ViewMut<'_, S>);

                // ---- loss ----
                /// How many of `targets` are counted by the loss (those below `vocab`; the
                /// rest are ignored, as [`IGNORE_INDEX`] is).
                fn count_targets(&self, targets: View<'_, u32>, vocab: usize) -> usize;
                /// Per row: `loss = logsumexp(logits) − logits[target]` written to `losses` (0
                /// for ignored rows); returns their sum (f64, in row order), or 0 where the
                /// backend adds it to a sum kept on the device for [`Kernels::take_loss`]. If
                /// `dlogits_scale` is `Some(s)`,
                /// overwrites `logits` with `s·(softmax(logits) − onehot(target))` (zeros for
                /// ignored rows).
                fn cross_entropy(
                    &self,
                    s: CeShape,
                    logits: ViewMut<'_, f32>,
                    targets: View<'_, u32>,
                    losses: ViewMut<'_, f32>,
                    dlogits_scale: Option<f32>,
                ) -> f64;
                /// Vocabulary-parallel cross-entropy, first half (Megatron-LM's
                /// `_VocabParallelCrossEntropy`): per row of this rank's logits, its max m,
                /// Σ exp(z − m) and the target's logit when this rank holds it (else 0), into
                /// `stats` `[rows, 3]`; with `keep_exp` the logits become exp(z − m).
                fn ce_shard_stats(
                    &self,
                    s: CeShardShape,
                    logits: ViewMut<'_, f32>,
                    targets: View<'_, u32>,
                    stats: ViewMut<'_, f32>,
                    keep_exp: bool,
                );
                /// Second half, from every rank's `stats` gathered in rank order (`all`,
                /// `[ranks, rows, 3]`; this rank is `rank`): the losses log Σ_ranks − z_t (0 for
                /// an ignored target) and, with `dlogits_scale`, the gradient in place of the
                /// exponentials `ce_shard_stats` kept: (softmax − onehot)·scale. Returns the
                /// loss sum.
                #[allow(clippy::too_many_arguments)]
                fn ce_shard_finish(
                    &self,
                    s: CeShardShape,
                    logits: ViewMut<'_, f32>,
                    targets: View<'_, u32>,
                    all: View<'_, f32>,
                    rank: usize,
                    losses: ViewMut<'_, f32>,
                    dlogits_scale: Option<f32>,
                ) -> f64;

                // ---- optimizer ----
                /// One torch.optim.AdamW step over a flat slice (Loshchilov & Hutter 2019, Alg.
                /// 2) on the f32 `master` weights, reading `grads · h.grad_scale`. With
                /// `params`, the updated master weights are also rounded into the 16-bit
                /// parameters (mixed precision).
                #[allow(clippy::too_many_arguments)]
                fn adamw_step(
                    &self,
                    h: AdamWParams,
                    master: ViewMut<'_, f32>,
                    grads: View<'_, G>,
                    m: ViewMut<'_, f32>,
                    v: ViewMut<'_, f32>,
                    params: Option<(ViewMut<'_, S>, Rounding)>,
                );
            }
        }
    };
}
// Path-based export, so that generators in other modules can name it (`super::kernel_interface!`).
pub(crate) use kernel_interface;

/// Emits `impl Kernels<S, G> for` a wrapper backend whose inner backend is `self.inner`, from
/// the kernel interface's list: `wrapper_kernels!([generics] Type, call; hooks {..} ops {..})`.
/// Hooks go to the inner backend as they are; every op without a default body becomes
/// `call!(self, op_name, arg, ..)`; an op with a default (a composite) keeps it, so the wrapper
/// sees its parts. `@each` walks the entries, since an entry ends in either `;` or a body.
macro_rules! wrapper_kernels {
    ([$($gen:tt)*] $ty:ty, $call:ident; hooks { $($hook:tt)* } ops { $($op:tt)* }) => {
        impl<S: Elem, G: Elem, $($gen)*> Kernels<S, G> for $ty {
            wrapper_kernels!(@each $call hook $($hook)*);
            wrapper_kernels!(@each $call op $($op)*);
        }
    };
    (@each $call:ident $kind:ident) => {};
    (@each $call:ident $kind:ident $(#[$attr:meta])* fn $name:ident $args:tt $(-> $ret:ty)?;
     $($rest:tt)*) => {
        wrapper_kernels!(@$kind $call required $name $args ($($ret)?));
        wrapper_kernels!(@each $call $kind $($rest)*);
    };
    (@each $call:ident $kind:ident $(#[$attr:meta])* fn $name:ident $args:tt $(-> $ret:ty)?
     $default:block $($rest:tt)*) => {
        wrapper_kernels!(@$kind $call provided $name $args ($($ret)?));
        wrapper_kernels!(@each $call $kind $($rest)*);
    };
    (@hook $call:ident $_provided:ident $name:ident (&self $(, $arg:ident: $ty:ty)* $(,)?)
     ($($ret:ty)?)) => {
        fn $name(&self $(, $arg: $ty)*) $(-> $ret)? {
            self.inner.$name($($arg),*)
        }
    };
    (@op $call:ident required $name:ident (&self $(, $arg:ident: $ty:ty)* $(,)?)
     ($($ret:ty)?)) => {
        fn $name(&self $(, $arg: $ty)*) $(-> $ret)? {
            $call!(self, $name, $($arg),*)
        }
    };
    (@op $call:ident provided $($_:tt)*) => {};
}
pub(crate) use wrapper_kernels;

/// Emits the [`Kernels`] trait from the list: both sections verbatim, defaults included.
macro_rules! kernels_trait {
    (hooks { $($hook:tt)* } ops { $($op:tt)* }) => {
        /// Every op of a Llama-family training step, for activations stored as `S` and
        /// parameter gradients stored as `G` (see [`crate::dtype`]): `Kernels<f32>` is plain
        /// fp32 training, `Kernels<bf16>` bf16 mixed precision, `Kernels<bf16, f32>` bf16 with
        /// fp32 gradients. All arithmetic is f32; statistics (`rstd`, `lse`), logits and
        /// losses are always f32.
        ///
        /// Parameter gradients (`dw`, `dbias`, `dweight`, `dwte`) are always accumulated
        /// (`+=`), each call rounding into `G` once.
        ///
        /// The methods are listed in `kernel_interface!` (this module's source), which
        /// generates this trait and the forwarding wrapper [`Observed`].
        pub trait Kernels<S: Elem = f32, G: Elem = S>: Send + Sync {
            $($hook)*
            $($op)*
        }
    };
}
kernel_interface!(kernels_trait);

/// `adamw_step`'s last argument for fp32 training (the weights are the master weights).
pub const NO_PARAMS: Option<(ViewMut<'static, f32>, Rounding)> = None;
